"""Split-decision report: traces -> tables -> fit -> simulate -> decide -> render (docs/architecture.md section 7).

In-process use (e.g. `splitscope demo`):

    from tracer.report.build import ReportOptions, build_report
    from tracer.report.render import render
    from tracer.report.simulate import SLO

    report = build_report(["traces.jsonl"], ReportOptions(slo=SLO(ttft_s=1.0, itl_s=0.1)))
    print(render(report, "md"))       # or "html", "json"

`tracer.report.simulate.simulate(layout, workload, costs, slo)` predicts per-request TTFT and inter-token
gaps for a layout; the tests (tests/synthetic.py) write traces from a known cost model with it.
"""
