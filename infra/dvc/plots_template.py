"""Write infra/dvc/plots_template.html: the page `dvc plots show` fills (.dvc/config's plots.html_template), with
Vega, Vega-Lite and Vega-Embed inlined, so the plots render without a network. DVC's own page loads them from a
CDN and is blank offline.

    pip install vl-convert-python && python infra/dvc/plots_template.py

The bundle comes from vl-convert (the Vega libraries and their dependencies in one script that sets
window.vegaEmbed, as DVC's plot divs call it). The template has no `{scripts}` placeholder, so DVC's CDN tags are
never added.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).with_name("plots_template.html")

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC plots</title>
    <!-- vega, vega-lite and vega-embed (vl-convert %(version)s's bundle): no network needed -->
    <script type="text/javascript">%(bundle)s</script>
    <style>
        body { font-family: sans-serif; }
        table { border-spacing: 15px; }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def main() -> int:
    import vl_convert

    bundle = vl_convert.javascript_bundle()
    if "</script" in bundle:
        raise SystemExit("the bundle holds '</script': it cannot be inlined as is")
    text = PAGE % {"bundle": bundle, "version": getattr(vl_convert, "__version__", "?")}
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(OUT)
    print(f"{OUT}: {len(text) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
