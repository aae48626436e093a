"""What keeps a run alive or ends it cleanly: preemption signals, out of memory, non-finite values,
a console gone, and the deliberate faults that test all of these.
"""
