"""``python -m elastictrain COMMAND``: the tools beside the runner (storage CLI, report, benches,
fault injection). Each is imported only when asked for."""

# command -> (module, what it does); the module's main(argv) returns the exit code.
TOOLS = {
    "ls": ("elastictrain.tools.cli", "list committed checkpoints"),
    "verify": ("elastictrain.tools.cli", "re-read and check every checkpoint's checksums"),
    "inspect": ("elastictrain.tools.cli", "show a checkpoint's manifest and tensors"),
    "prune": ("elastictrain.tools.cli", "apply a retention policy"),
    "export": (
        "elastictrain.tools.export",
        "write the consolidated model: a Hugging Face folder, .safetensors or .pt",
    ),
    "report": ("elastictrain.observe.report", "draw a run's life from its event log"),
    "bench": ("elastictrain.bench.commands", "measure checkpoints, recovery and overhead"),
    "chaos": ("elastictrain.tools.chaos", "inject cluster faults into a torchrun command"),
}
