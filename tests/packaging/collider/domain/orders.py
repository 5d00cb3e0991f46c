from dataclasses import dataclass


@dataclass(frozen=True)
class Order:
    id: int
    items: int

    def total_cents(self, unit_cents: int) -> int:
        return self.items * unit_cents
