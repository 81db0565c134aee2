"""Chaos preemption drills: scenarios, invariant verdicts, timelines."""
