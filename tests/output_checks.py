"""Checks on what a job printed (shared by tests/test_orderly_exit.py and
tests/test_examples_output.py): TensorFlow's error-severity log lines and error words, and
warnings a user should not have to read."""

import re

# What a successful job must not print: TensorFlow's error-severity log lines ("E0000
# 00:00:... file.cc:123] ...", "F..." for fatal) whatever their text, and any other line
# saying error (gRPC's "Error received from peer", Python's "...Error: ..."). TensorFlow's
# info/warning lines are judged by their severity: the oneDNN notice TensorFlow 2.21 prints
# at import (whatever TF_CPP_MIN_LOG_LEVEL says) mentions "round-off errors".
_TF_LOG_LINE = re.compile(r"(^|\s)([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\]")
_ERROR_WORD = re.compile(r"error", re.IGNORECASE)


def error_lines(output):
    def is_error(line):
        tf_log = _TF_LOG_LINE.search(line)
        return tf_log.group(2) in "EF" if tf_log else bool(_ERROR_WORD.search(line))
    return [line for line in output.splitlines() if is_error(line)]


def noise_lines(output):
    """Lines a user should not have to read after a successful run: warnings and errors."""
    return [line for line in output.splitlines() if re.search(r"warn", line, re.IGNORECASE)
            ] + error_lines(output)
