"""The Decode page's SVG charts and its HTML sentences: exact colours, ticks, positions and escaping."""

import base64
import io
import re

import numpy as np
from PIL import Image

from ui import svg
from ui.widgets import markdown_html, md_escape


def svg_text(img_tag: str) -> str:
    """The SVG inside an <img src="data:image/svg+xml;base64,...">."""
    source = re.search(r'src="data:image/svg\+xml;base64,([^"]+)"', img_tag).group(1)
    return base64.b64decode(source).decode("utf-8")


def test_colours_run_from_the_lightest_stop_to_the_darkest():
    rgb = svg.colours(np.array([0.0, 0.5, 1.0, 1.7]))
    assert rgb.tolist() == [[255, 255, 217], [65, 182, 196], [8, 29, 88], [8, 29, 88]]  # 1.7 is clipped to 1


def test_the_triangle_image_has_a_pixel_per_cell_and_white_future():
    weights = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=np.float32)
    tag = svg.heatmap_svg(weights, ["0:<bos>", "1:a&b", "2:<script>"], "attention")
    inner = svg_text(tag)
    png = re.search(r'href="data:image/png;base64,([^"]+)"', inner).group(1)
    image = Image.open(io.BytesIO(base64.b64decode(png)))
    assert image.size == (3, 3)
    assert image.getpixel((0, 0)) == (8, 29, 88)          # weight 1: the darkest
    assert image.getpixel((1, 0)) == (255, 255, 255)      # above the diagonal: white
    assert image.getpixel((0, 1)) == (65, 182, 196)       # weight 0.5
    assert "&lt;script&gt;" in inner and "1:a&amp;b" in inner and "<script>" not in inner
    assert 'alt="attention"' in tag


def test_a_long_context_thins_its_labels():
    n = 200
    inner = svg_text(svg.heatmap_svg(np.tril(np.full((n, n), 0.1, dtype=np.float32)), [str(i) for i in range(n)],
                                     "attention"))
    row_labels = re.findall(r'text-anchor="end" dominant-baseline="middle">(\d+)</text>', inner)
    assert row_labels[:3] == ["0", "10", "20"] and len(row_labels) == 20  # 340 px / 17 px: every 10th of 200


def test_nice_ticks():
    assert svg.nice_ticks(32768) == [0, 10000, 20000, 30000, 40000]
    assert svg.nice_ticks(14336) == [0, 5000, 10000, 15000]
    assert svg.nice_ticks(7) == [0, 2, 4, 6, 8]
    assert svg.nice_ticks(0) == [0]


def test_the_line_chart_puts_the_largest_value_on_the_top_tick():
    tag = svg.line_chart_svg([0, 1, 2], {"held <B>": [0, 5, 10], "reserved": [10, 10, 10]}, "step", "bytes",
                             "cache", dashed=("reserved",), number=lambda v: f"{v:,}")
    inner = svg_text(tag)
    held, reserved = re.findall(r'<polyline points="([^"]+)"', inner)
    ys = [float(point.split(",")[1]) for point in held.split()]
    top = float(reserved.split()[0].split(",")[1])
    assert ys[2] == top < ys[1] < ys[0]  # 10 is the top tick; 0 the bottom
    assert ys[0] - ys[1] == ys[1] - ys[2]  # linear
    assert inner.count('stroke-dasharray="7 5"') == 2  # the reserved line and its legend sample
    assert "held &lt;B&gt;" in inner and ">10<" in inner


def test_markdown_sentences_become_escaped_html():
    assert markdown_html("Chose **me** (id 3)") == "Chose <b>me</b> (id 3)"
    assert markdown_html("**" + md_escape("<b>*x*</b> a\\b") + "**") == "<b>&lt;b&gt;*x*&lt;/b&gt; a\\b</b>"
    assert markdown_html("an **open bold") == "an <b>open bold</b>"
