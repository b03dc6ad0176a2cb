"""``python -m elastictrain bench SUBCOMMAND``: manual measurements, each side by side with its floor
in one run (timings on a shared machine are noisy; ratios measured together are not).

- ``persist``: a checkpoint's cost on your storage against a copy, a raw write and a raw read
- ``sharded``: FSDP2 sharded checkpoints against their floors and DCP
- ``recovery``: where the time goes from a killed worker to training again
- ``tiers``: what the local tier buys when the durable tier is slow
- ``overhead``: the runner's per-step cost against a plain DDP loop
- ``loader``: loader workers against in-process loading

``commands`` parses the command line; ``child`` starts the torchrun jobs some of them run.
"""
