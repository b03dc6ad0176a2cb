"""Membership epochs (``--replace-in-place``, ``init_distributed(replace_in_place=True)``): the
survivors of a death keep their processes and state, and train on with a replacement or without
a lost node, with no torchrun restart.

``states`` names an epoch's states and every transition; ``driver`` moves a process through them,
the runner's and library mode's alike; ``members`` finds who is back, ``agreement`` what they
agree as an epoch begins, ``epoch_end`` fails an ended epoch's collectives, ``supervisor`` is the
process torchrun starts (a training process and its spare), and ``recovering`` is
``CheckpointManager.run``'s loop. Uses the cluster and the checkpoint session; the checkpoint
package never imports it. Its ``__init__`` imports nothing: the supervisor imports no torch.
"""
