"""Checkpoints: the on-disk format (store.py), what goes in (state.py), which one a run resumes
from (resume.py), asynchronous writes, the mirror, and the one-run-per-directory lock.
"""
