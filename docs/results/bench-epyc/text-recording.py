"""The text stage's scoring against bare scoring per combination of the default experiment
(docs/performance.md), with benchmarks/bench.py's own timing (`_time_windows`; when its
log was made, the windows scored 3 times each way in turn, the fastest kept; since then,
windows 2 .. n, the passes over the first alone subtracted), run in an experiment
directory whose text jobs have run (their teacher slice ids are read):

    .venv/bin/python docs/results/bench-epyc/text-recording.py new|old   (repository root)

`old` loads the recorder (src/qdiff/core/forced.py) of commit 0a16a85 in place of this
checkout's, from /tmp/forced_old.py (`git show 0a16a85:src/qdiff/core/forced.py`).
"""

import importlib.util
import sys
from pathlib import Path

import yaml


def use_old_recorder() -> None:
    spec = importlib.util.spec_from_file_location("qdiff.core.forced", "/tmp/forced_old.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["qdiff.core.forced"] = module
    spec.loader.exec_module(module)


def main(which: str) -> None:
    if which == "old":
        use_old_recorder()
    sys.path.insert(0, "benchmarks")
    import bench

    from qdiff.core.config import model_file, validate
    from qdiff.core.io import load_arrays
    from qdiff.core.labels import Combination
    from qdiff.core.settings import DeviceSettings
    from qdiff.core.stages import TEXT
    from qdiff.core.text import windows
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel

    experiment, _ = validate(yaml.safe_load(Path("config/config.yaml").read_text()), Path.cwd())
    log = init_backend(Path("build/text-recording-errors.txt"))
    total = {"bare": 0.0, "stage": 0.0}
    for combo in experiment.all_combinations():
        spec = experiment.spec(TEXT, combo)
        teacher = Combination.parse(combo.model, spec["text"]["teacher"])
        ids = None if teacher == combo else load_arrays(Path(TEXT.data(teacher)))["slice_ids"]
        settings = DeviceSettings.from_config(spec["settings"])
        n_ctx = spec["text"]["n_ctx"]
        with LoadedModel(Path(model_file(combo.model, combo.dequant)), settings, n_ctx) as model:
            text = model.tokenize(Path(spec["text"]["file"]).read_text(), parse_special=False)
            cut = windows(text, n_ctx, spec["text"]["windows"], model.bos_added())
            took = dict.fromkeys(bench.TEXT_TIMINGS, 0.0)
            top_k = ids.shape[-1] if ids is not None else spec["text"]["top_k"]
            bench._time_windows(model, cut, ids, top_k, took)
        total = {way: total[way] + took[way] for way in total}
        print(
            f"{which} {combo.model} {combo.device} {combo.dequant}: bare {took['bare']:.2f} s, "
            f"stage {took['stage']:.2f} s, ratio {took['stage'] / took['bare']:.3f}",
            flush=True,
        )
    del log
    print(
        f"{which} all: bare {total['bare']:.2f} s, stage {total['stage']:.2f} s, "
        f"ratio {total['stage'] / total['bare']:.3f}"
    )


if __name__ == "__main__":
    main(sys.argv[1])
