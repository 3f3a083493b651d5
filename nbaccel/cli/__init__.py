"""The ``nbaccel`` command line: ``config``, ``env``, ``launch`` and ``test`` (entry point: :mod:`nbaccel.cli.main`)."""
