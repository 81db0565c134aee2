"""Reading a process's /metrics the way Prometheus would: over HTTP, through
`prometheus_client`'s own text parser."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_SECONDS = 10


@dataclass(frozen=True)
class Scrape:
    """One scrape: every family by name (as the parser names it) and every sample."""

    families: dict[str, str]  # family name -> its help text
    types: dict[str, str]  # family name -> counter, gauge, histogram, ...
    samples: list[tuple[str, dict[str, str], float]]

    def value(self, sample_name: str, **labels: str) -> float:
        """The sum of the samples of that name whose labels include ``labels`` (0: none)."""
        return sum(
            value
            for name, sample_labels, value in self.samples
            if name == sample_name and labels.items() <= sample_labels.items()
        )

    def has(self, sample_name: str) -> bool:
        return any(name == sample_name for name, _, _ in self.samples)

    def labels_of(self, sample_name: str) -> list[dict[str, str]]:
        return [labels for name, labels, _ in self.samples if name == sample_name]


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_SECONDS) as response:
        text = response.read().decode()
    return parse(text)


def parse(text: str) -> Scrape:
    families: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        families[family.name] = family.documentation
        types[family.name] = family.type
        for sample in family.samples:
            samples.append((sample.name, dict(sample.labels), float(sample.value)))
    return Scrape(families, types, samples)
