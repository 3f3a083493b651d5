"""What workers display reaches the cell, in a real kernel through nbclient: HTML, figures, order, ranks."""

from __future__ import annotations

import pytest

from .nbkernel import NotebookKernel, error, result_text

pytestmark = pytest.mark.timeout(240)
WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    config = tmp_path_factory.mktemp("kernel") / "nbaccel_config.yaml"
    with NotebookKernel(config) as nb:
        cell = nb.run("%load_ext nbaccel\n"
                      "import os\n"
                      "from IPython.display import HTML, display\n"
                      "import matplotlib.pyplot as plt\n")
        assert error(cell) is None, cell.outputs
        yield nb


def shown(cell, rank_prefix: str = "[rank0]") -> list[str]:
    """The cell's outputs in order: one rank's printed lines, and the mime type each display led with."""
    items = []
    for output in cell.outputs:
        if output.output_type == "stream":
            items += [line for line in output.text.splitlines() if line.startswith(rank_prefix)]
        elif output.output_type == "display_data" and WIDGET not in output.data:
            items.append(next(m for m in ("text/html", "image/png", "text/plain") if m in output.data))
    return items


RICH_CELL = ("%%accel_launch -n 2 {flags}\n"
             "rank = int(os.environ['RANK'])\n"
             "print('loss table for rank', rank)\n"
             "display(HTML(f'<table><tr><td>rank {rank}</td></tr></table>'))\n"
             "print('curve next')\n"
             "plt.plot([3, 2, 1]); plt.title(f'rank {rank}'); plt.show()\n"
             "print('done', rank)\n")


@pytest.mark.parametrize("flags", ["", "--start_method spawn"], ids=["fork", "spawn"])
def test_rank0_html_and_figure_are_in_the_cell_in_order_with_its_lines(kernel, flags):
    cell = kernel.run(RICH_CELL.replace("{flags}", flags))
    assert error(cell) is None, cell.outputs
    assert shown(cell) == ["[rank0]: loss table for rank 0", "text/html", "[rank0]: curve next", "image/png",
                           "[rank0]: done 0"]
    html = [o.data["text/html"] for o in cell.outputs if o.output_type == "display_data" and "text/html" in o.data]
    assert html == ["<table><tr><td>rank 0</td></tr></table>"]  # rank 1's display was not asked for
    png = next(o.data["image/png"] for o in cell.outputs if o.output_type == "display_data" and "image/png" in o.data)
    assert png.startswith("iVBORw0KGgo")  # a real PNG (base64), saved with the notebook


def test_rank1_displays_appear_when_asked_for(kernel):
    only1 = kernel.run(RICH_CELL.replace("{flags}", "--ranks 1"))
    assert error(only1) is None, only1.outputs
    assert shown(only1, "[rank1]") == ["[rank1]: loss table for rank 1", "text/html", "[rank1]: curve next",
                                       "image/png", "[rank1]: done 1"]
    both = kernel.run(RICH_CELL.replace("{flags}", "--ranks 0,1"))
    html = [o.data["text/html"] for o in both.outputs if o.output_type == "display_data" and "text/html" in o.data]
    assert len(html) == 4 and sum("[rank1]" in h for h in html) == 2 and sum("[rank0]" in h for h in html) == 2
    assert any("[rank1]" in h and "rank 1</td>" in h for h in html)  # labelled with the rank that made it


def test_update_display_updates_in_place_and_clear_output_clears_only_the_ranks_displays(kernel):
    cell = kernel.run("%%accel_launch -n 2\n"
                      "from IPython.display import clear_output, update_display\n"
                      "print('a printed line')\n"
                      "handle = display('epoch 1', display_id='progress')\n"
                      "update_display('epoch 2', display_id='progress')\n"
                      "for frame in range(3):\n"
                      "    clear_output(wait=True)\n"
                      "    display(HTML(f'<b>frame {frame}</b>'))\n")
    assert error(cell) is None, cell.outputs
    visible = [o.data for o in cell.outputs if o.output_type == "display_data" and o.data and WIDGET not in o.data]
    assert [d.get("text/html", d.get("text/plain")) for d in visible] == ["<b>frame 2</b>"]
    texts = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    assert "[rank0]: a printed line" in texts and "[rank1]: a printed line" in texts  # other output stays
    assert any(WIDGET in o.get("data", {}) for o in cell.outputs)  # and so does the status panel


def test_fifty_launches_that_display_and_use_tqdm_auto_leave_the_kernel_responsive(kernel):
    cell = kernel.run("from nbaccel import notebook_launcher\n"
                      "def step(i):\n"
                      "    from tqdm.auto import tqdm\n"
                      "    for _ in tqdm(range(3), desc=f'run {i}'):\n"
                      "        pass\n"
                      "    display(HTML(f'<i>run {i}</i>'))\n"
                      "    return i\n"
                      "done = [notebook_launcher(step, (i,), num_processes=2) for i in range(50)]\n"
                      "len(done), done[-1]\n")
    assert error(cell) is None, cell.outputs
    assert result_text(cell) == "(50, 49)"
    html = [o.data["text/html"] for o in cell.outputs if o.output_type == "display_data" and "text/html" in o.data]
    assert html == [f"<i>run {i}</i>" for i in range(50)]
    assert not any(WIDGET in o.get("data", {}) for o in cell.outputs)  # no tqdm widget bars
    assert result_text(kernel.run("21 * 2")) == "42"
