"""The loop's side of data: the `Data` bundle a dataset builder returns, and the resumable order
in which the loop reads its samples.
"""
