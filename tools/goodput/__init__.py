"""``pulse bench goodput``: a fault campaign against a real stack, and how much training survived it.

On this machine, nothing shared touched: a private Redis, the orchestrator and one simulated
agent per rank as child processes, and a DeepSpeed job of ``trainer.example`` on gloo. The same
job runs fault-free, then under a fault drawn every ``--fault-every`` seconds; the result is a
JSON object (``goodput_ratio``, steps lost by fault kind, detection, reroute and rejoin times,
...) and a picture. The fault mix and every figure's definition: docs/design/goodput.md.
"""

from tools.goodput.campaign import Campaign, run_goodput
from tools.goodput.model import CAMPAIGN_FAULTS, DEGRADING, CampaignError

__all__ = ["CAMPAIGN_FAULTS", "DEGRADING", "Campaign", "CampaignError", "run_goodput"]
