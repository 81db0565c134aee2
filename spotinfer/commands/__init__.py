"""One module per `spotinfer` subcommand; each exposes `register(subparsers)`.

A command module must import nothing heavy at module level (vLLM, torch): the CLI imports
every command module to build its help, and `spotinfer plan` should answer at once.
"""
