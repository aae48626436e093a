"""The one exception type for bad input (config, data, checkpoint).

`train.py` turns it into a one-paragraph message on stderr and exit code 2, before anything in
`run.out_dir` is written or changed. Raise it with a message that names the key or file and says
what was expected.
"""

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """User-facing input error: the message is printed as is, and the process exits with 2."""
