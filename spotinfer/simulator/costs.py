"""What a node costs per hour, spot and on-demand, per instance type, with the source of each
price beside it. Prices are approximate list prices (they change by region, day and contract);
a run states which table it used."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spotinfer.simulator.calibration import DATA_DIR
from spotinfer.simulator.node import Market

DEFAULT_COSTS = DATA_DIR / "costs.json"


@dataclass(frozen=True)
class InstancePrice:
    instance_type: str
    description: str
    spot_usd_per_hour: float
    on_demand_usd_per_hour: float
    source: str

    def __post_init__(self) -> None:
        if self.spot_usd_per_hour < 0 or self.on_demand_usd_per_hour < 0:
            raise ValueError(f"{self.instance_type}: prices must not be negative")

    def usd_per_hour(self, market: Market) -> float:
        return self.spot_usd_per_hour if market == Market.SPOT else self.on_demand_usd_per_hour


@dataclass(frozen=True)
class CostTable:
    prices: dict[str, InstancePrice]
    note: str = ""

    def price(self, instance_type: str) -> InstancePrice:
        if instance_type not in self.prices:
            known = ", ".join(sorted(self.prices))
            raise KeyError(f"no price for instance type {instance_type!r}; known: {known}")
        return self.prices[instance_type]


def load(path: Path = DEFAULT_COSTS) -> CostTable:
    data = json.loads(path.read_text())
    prices = {
        name: InstancePrice(
            instance_type=name,
            description=str(row["description"]),
            spot_usd_per_hour=float(row["spot_usd_per_hour"]),
            on_demand_usd_per_hour=float(row["on_demand_usd_per_hour"]),
            source=str(row["source"]),
        )
        for name, row in data["instance_types"].items()
    }
    return CostTable(prices, str(data.get("note", "")))
