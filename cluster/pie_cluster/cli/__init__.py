"""The ``pie`` command line: the user's commands (submit, upload, list, attach, abort) over HTTP, and the
operator's (start, stop, status, drain) on the Ray cluster."""
