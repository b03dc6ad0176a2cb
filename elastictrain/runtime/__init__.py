"""What keeps a process honest while it runs, whatever it trains: the hang watchdog and the
orphan exit (``watchdog``), stop signals (``signals``) and the decisions every rank takes
together at a step (``control``). Imports no torch at package level: ``__main__`` installs the
stop signals before torch is imported.
"""
