"""Loading the example tasks' data from the folder of their YAML files, so that lm-eval finds it from
any working directory (a plain `dataset_kwargs.data_files` path is read relative to the working
directory). lm-eval calls `custom_dataset` with the task's `dataset_kwargs` and `metadata`."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def local_jsonl(file: str, split: str = "test", **_metadata) -> datasets.DatasetDict:
    """{split: the rows of HERE/file}."""
    return datasets.DatasetDict({split: datasets.load_dataset("json", data_files=str(HERE / file), split="train")})
