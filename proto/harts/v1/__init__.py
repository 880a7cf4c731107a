"""Generated protobuf modules of the `harts.v1` package (regenerate with `make proto`)."""
