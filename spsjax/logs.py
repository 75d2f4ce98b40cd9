"""Logging for the binaries: this project's progress lines, not every library's internals.

Orbax logs each checkpoint step at INFO in a dozen lines; `quiet_libraries()` keeps their warnings
and errors and drops their info, so a training log reads as progress, evaluation and saves.
"""

import logging as std_logging

from absl import logging

_NOISY = ('/orbax/', '/etils/', '/tensorflow_datasets/')


class _DropLibraryInfo(std_logging.Filter):

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.WARNING:
      return True
    return not any(part in record.pathname for part in _NOISY)


def quiet_libraries() -> None:
  """Drops INFO records of the libraries in `_NOISY` from absl's handler."""
  logging.get_absl_handler().addFilter(_DropLibraryInfo())
