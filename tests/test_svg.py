"""The SVG charts of the Decode and Flash pages and their HTML sentences: exact colours, ticks, positions and
escaping."""

import base64
import io
import re
from html import unescape

import numpy as np
from PIL import Image

from model.engine.flash import tiled_attention
from ui import svg
from ui.widgets import markdown_html, md_escape


def svg_text(img_tag: str) -> str:
    """The SVG inside an <img src="data:image/svg+xml;base64,...">."""
    source = re.search(r'src="data:image/svg\+xml;base64,([^"]+)"', img_tag).group(1)
    return base64.b64decode(source).decode("utf-8")


def test_colours_run_from_the_lightest_stop_to_the_darkest():
    rgb = svg.colours(np.array([0.0, 0.5, 1.0, 1.7]))
    assert rgb.tolist() == [[255, 255, 217], [65, 182, 196], [8, 29, 88], [8, 29, 88]]  # 1.7 is clipped to 1


def png_image(inner: str) -> Image.Image:
    """The (first) PNG inside an SVG, in RGB (the triangle's is paletted)."""
    png = re.search(r'href="data:image/png;base64,([^"]+)"', inner).group(1)
    return Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB")


def test_the_triangle_image_has_a_pixel_per_cell_and_white_future():
    weights = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=np.float32)
    tag = svg.heatmap_svg(weights, ["0:<bos>", "1:a&b", "2:<script>"], "attention")
    inner = svg_text(tag)
    image = png_image(inner)
    assert image.size == (3, 3)
    assert image.getpixel((0, 0)) == (8, 29, 88)          # weight 1: the darkest
    assert image.getpixel((1, 0)) == (255, 255, 255)      # above the diagonal: white
    assert image.getpixel((0, 1)) == (65, 182, 196)       # weight 0.5
    assert "&lt;script&gt;" in inner and "1:a&amp;b" in inner and "<script>" not in inner
    assert 'alt="attention"' in tag


def test_a_long_context_thins_its_labels():
    n = 200
    inner = svg_text(svg.heatmap_svg(np.tril(np.full((n, n), 0.1, dtype=np.float32)), [f"{i}:tok" for i in range(n)],
                                     "attention"))  # every 10th label is shown, by its position alone
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


def walk_of(n: int, block: int):
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((n, 4)).astype(np.float32) for _ in range(3))
    return tiled_attention(q, k, v, block, block, causal=True).steps


def test_the_tile_grid_colours_each_cell_by_its_state_and_frames_the_tile_being_read():
    steps = walk_of(4, 2)  # tiles (0,0) read, (0,1) skipped, (1,0) read, (1,1) read
    assert [(s.q_block, s.k_block, s.skipped) for s in steps] == [(0, 0, False), (0, 1, True), (1, 0, False),
                                                                   (1, 1, False)]
    inner = svg_text(svg.tile_grid_svg(steps, 2, ["0:<s>", "1:a", "2:b", "3:c"], ("keys", "queries"), "walk"))
    image = png_image(inner)
    colour = {s: tuple(int(svg.TILE_COLOURS[s][i:i + 2], 16) for i in (1, 3, 5)) for s in svg.TILE_STATES}
    expected = [["done", "masked", "skipped", "skipped"],
                ["done", "done", "skipped", "skipped"],
                ["current", "current", "todo", "masked"],  # (2, 3) lies above the diagonal of a tile not yet read
                ["current", "current", "todo", "todo"]]
    assert image.size == (4, 4)
    assert [[image.getpixel((c, r)) for c in range(4)] for r in range(4)] == [[colour[s] for s in row]
                                                                              for row in expected]
    left, top, side = (float(v) for v in re.search(r'<image x="([\d.]+)" y="([\d.]+)" width="([\d.]+)"',
                                                   inner).groups())
    cell = side / 4
    frame = re.search(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)" fill="none" '
                      r'stroke="#d9480f"', inner).groups()
    assert [float(v) for v in frame] == [left, top + 2 * cell, 2 * cell, 2 * cell]  # query block 1 × key block 0
    assert inner.count(">✕</text>") == 1
    scores = re.findall(r'font-size="13">(-?\d\.\d\d)</text>', inner)
    assert len(scores) == 3 + 4  # tile (0,0)'s three visible scores, then the four of the tile being read
    assert f"{steps[2].scores[1, 0]:.2f}" in scores
    assert "0:&lt;s&gt;" in inner and "<s>" not in inner


def test_a_long_walk_prints_no_scores_and_thins_its_labels():
    steps = walk_of(40, 8)
    inner = svg_text(svg.tile_grid_svg(steps, 0, [str(i) for i in range(40)], ("keys", "queries"), "walk"))
    assert png_image(inner).size == (40, 40)
    assert not re.findall(r'font-size="13">', inner)
    assert len(re.findall(r'text-anchor="end" dominant-baseline="middle">\d+</text>', inner)) < 40


def test_the_running_output_is_blue_below_zero_white_at_zero_red_above():
    inner = svg_text(svg.output_svg(np.array([[-2.0, 0.0, 2.0, 1.0]]), ["3:<b>"], "output"))
    image = png_image(inner)
    assert image.size == (4, 1)
    # 1 is three quarters up the scale: halfway between its stops #f4a582 and #d6604d (halves round to even)
    assert [image.getpixel((j, 0)) for j in range(4)] == [(5, 48, 97), (247, 247, 247), (103, 0, 31),
                                                           (229, 130, 104)]
    assert re.findall(r'font-size="13" fill="[^"]+">(-?\d\.\d\d)</text>', inner) == ["-2.00", "0.00", "2.00",
                                                                                     "1.00"]
    assert "3:&lt;b&gt;" in inner and ">−2<" in inner


def test_a_token_of_spaces_only_is_shown_as_its_spaces():
    from ui.widgets import probability_bars_html, shown

    assert (shown(" "), shown("  "), shown(" mèo"), shown("\n"), shown("")) == ("␣", "␣␣", " mèo", "↵", "∅")
    assert '<div class="lbl">␣</div>' in probability_bars_html([" "], [0.5], ["kept"], {"kept": "kept"})


def hover_titles(html: str) -> list[str]:
    return [unescape(title) for title in re.findall(r'<i title="([^"]*)"', html)]


def test_the_triangle_s_hover_says_query_key_and_weight_with_tokens_as_text():
    weights = np.array([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.125, 0.5, 0.375]], dtype=np.float32)
    labels = ["0:<bos>", "1:<b>", '2:"&']
    html = svg.heatmap_html(weights, labels, "attention", np.array([True, False, True]), "not kept")
    assert hover_titles(html) == ["0:<bos> → 0:<bos>: 1.0000", "1:<b>: not kept", '2:"& → 0:<bos>: 0.1250',
                                  '2:"& → 1:<b>: 0.5000', '2:"& → 2:"&: 0.3750']
    assert "<b>" not in html.replace('<div class="dl-heat"', "") and "1:&lt;b&gt;" in html and "&quot;&amp;" in html
    assert html.count("<div>") == 3 and "--n:3" in html


def test_a_large_triangle_s_hover_is_one_title_per_row_with_its_largest_weights():
    n = svg.HOVER_CELLS_UP_TO + 1
    weights = np.tril(np.full((n, n), 0.01, dtype=np.float32))
    weights[n - 1, [3, 7, 9]] = [0.5, 0.2, 0.3]
    html = svg.heatmap_html(weights, [f"{i}:t" for i in range(n)], "attention", np.ones(n, dtype=bool), "not kept")
    titles = hover_titles(html)
    assert len(titles) == n and titles[0] == "0:t → 0:t 0.0100"
    assert titles[-1] == "32:t → 3:t 0.5000 · 9:t 0.3000 · 7:t 0.2000"
    assert f'style="width:{100:.3f}%"' in html  # the last row spans every key


def test_a_long_triangle_s_hover_is_at_most_64_bands_of_rows_a_line_each():
    """Past HOVER_BANDS rows, consecutive rows share one title, a line per row (an element per row made a 245-row
    step view cost the browser more); every row is still said, in order, and the last band reaches the last key.
    Breaks if the bands skip a row or a band spans a row's keys wrong."""
    n = 200
    weights = np.tril(np.full((n, n), 0.001, dtype=np.float32))
    weights[n - 1, [0, 150]] = [0.6, 0.3]
    kept = np.ones(n, dtype=bool)
    kept[5] = False
    html = svg.heatmap_html(weights, [f"{i}:t" for i in range(n)], "attention", kept, "not kept")
    titles = hover_titles(html)
    assert len(titles) == 50  # bands of ceil(200 / 64) = 4 rows
    lines = [line for title in titles for line in title.split("\n")]
    assert len(lines) == n and lines[5] == "5:t: not kept" and lines[4].startswith("4:t → ")
    assert lines[-1] == "199:t → 0:t 0.6000 · 150:t 0.3000 · 1:t 0.0010"
    assert 'style="flex:4"' in html and f'style="width:{100:.3f}%"' in html


def test_labels_of_points_close_together_do_not_overlap():
    """B = 3, B = 4 and a prefill a few pixels apart on the roofline: each label on its own free side (breaks if
    every label goes to the right of its point, as they were drawn, over each other)."""
    points = [(200, 100, "B=3"), (216, 92, "B=4"), (222, 99, "prefill 10")]
    placed = svg.place_labels(points, 460)
    labels = [(x, y - svg.LABEL_LINE_PX, x + svg.LABEL_CHAR_PX * len(label), y)
              for (x, y), (_, _, label) in zip(placed, points)]
    dots = [(x - 6, y - 6, x + 6, y + 6) for x, y, _ in points]
    for i, a in enumerate(labels):
        for b in labels[i + 1:] + dots:
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)
    assert svg.place_labels([(200, 100, "B=1")], 460) == [(208, 94)]  # alone: right of its point, above it
