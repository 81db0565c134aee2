"""spotinfer: LLM inference on preemptible VMs that loses nothing when the cloud takes one away."""

__version__ = "0.1.0"
