"""What a run shows: metrics (console, metrics.jsonl, TensorBoard), GPU telemetry and MFU, the
profiler breakdown, run metadata, summary.json and the report.
"""
