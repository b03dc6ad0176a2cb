"""The runner's training: the process-level run (``runner``), one attempt's build (``attempt``)
and loop (``training``), one optimizer step (``loop``), which samples each rank draws (``data``,
``loader``, ``streams``), precision (``precision``) and the model's layout (``parallel``).

Uses the cluster, the checkpoint session and the in-place epochs; nothing below imports it.
"""
