"""The loop and only the loop: `trainer.py` runs it and holds the optimizer step; the small parts
beside it (precision, schedule, optimizer, EMA, RNG streams, best/early-stop monitor) each own their
state. Folders by concern: config/ (keys, files, overrides), data/ (the resumable order of samples),
checkpoint/ (save, verify, resume), distributed/ (torchrun, DDP, FSDP), guards/ (signals, out of
memory, non-finite values, injected faults), observe/ (metrics, telemetry, report). The loop imports
no model and no dataset: train.py hands it the builders.
"""
