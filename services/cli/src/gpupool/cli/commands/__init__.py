"""One module per ``gpupool`` subcommand, each exposing ``register(subparsers)``."""
