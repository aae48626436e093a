"""Tools that run the loop to check it or use what it made: `verify` (make verify) and its audits,
`sample` (text from a trained run), `report` (report.md for run directories).
"""
