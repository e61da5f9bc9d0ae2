"""``kiln port``: which tier a model is in, by trying it (see :mod:`kiln.port.assess`).

    from kiln.port import port
    report = port("mypkg.models:make")        # or "model.py", or a Hugging Face directory
    print(report.tier, [b.what for b in report.blockers])

Layers: source (what to load) → probe (Dynamo's graphs and breaks) → graphs (kiln's
placement, blockers) → cost (compile, validate, time, profile) → findings (tiers, fixes)
→ draw + report (pictures, Markdown/HTML/JSON, the terminal summary).
"""
from kiln.port.assess import PortReport, port

__all__ = ["PortReport", "port"]
