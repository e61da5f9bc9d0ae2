"""Phase progress: live on a terminal, silent elsewhere."""
import io
import time

from kiln.progress import Progress


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_live_line_on_terminal_shows_phase_and_elapsed():
    stream = FakeTTY()
    p = Progress(stream=stream, quiet=False)
    with p.phase("compile partition 1/1 (onnxruntime)"):
        time.sleep(1.1)
    text = stream.getvalue()
    assert "kiln: compile partition 1/1 (onnxruntime) …" in text
    assert "done in 1." in text
    assert p.timings["compile partition 1/1 (onnxruntime)"] >= 1.0


def test_silent_when_not_a_terminal_or_quiet():
    pipe = io.StringIO()
    with Progress(stream=pipe, quiet=False).phase("capture"):
        time.sleep(0.3)
    assert pipe.getvalue() == ""
    tty = FakeTTY()
    with Progress(stream=tty, quiet=True).phase("capture"):
        time.sleep(0.3)
    assert tty.getvalue() == ""
