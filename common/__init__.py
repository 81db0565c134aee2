"""The floor every process stands on: request dataclasses, validation, the one error model,
the messages that cross a process boundary, and what every gRPC server shares. It imports no
other package of the project."""
