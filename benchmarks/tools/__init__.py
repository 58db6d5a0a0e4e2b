"""One-off instruments behind design decisions: run them to re-check a decision, not to compare loaders.

The entry points users run (``benchmarks.run``, ``training``, ``gil``, ``sources``, ``ddp_train``) stay
in ``benchmarks/``; these reach into the library's private modules where they must, to time or count
its stages.
"""
