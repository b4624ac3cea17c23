"""Every SGLang name dspine relies on, in one place, per SGLang source file — checked against the wheels'
source (downloaded, never imported) for each release we support: 0.5.17 (runs on our H200 with torch 2.11)
and 0.5.23 (the newest; needs torch 2.14). A break in a new release shows in CI as the missing name.

Users of these names: `dspine export --to sglang` (DFlash's config fields and weight names, export.py) and
the serving plugin (dspine/sglang_plugin: the model it subclasses, the registries it registers with, the two
worker methods it hooks and the attributes it reads there).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

RELEASES = ("0.5.17", "0.5.23")

NAMES: dict[str, list[str]] = {
    # the draft model SGLang builds from an exported checkpoint, and the weight names it loads
    "sglang/srt/models/dflash.py": [
        r"class DFlashDraftModel\b",
        r"def load_weights\b",
        r"stacked_params_mapping",
        r"EntryClass",
        r"self\.fc\s*=",
        r"self\.hidden_norm\s*=",
        r"self\.norm\s*=",
        r"\"q_proj\"",
        r"\"k_proj\"",
        r"\"v_proj\"",
        r"\"gate_proj\"",
        r"\"up_proj\"",
        r"o_proj",
        r"down_proj",
        r"q_norm",
        r"k_norm",
        r"input_layernorm",
        r"post_attention_layernorm",
        r"self\.block_size\s*=",
        r"self\.layers\s*=",
        r"LogitsProcessorOutput\(",
    ],
    # the DFlash worker: the two methods the plugin hooks, and what it reads from the worker
    "sglang/srt/speculative/dflash_worker_v2.py": [
        r"def _maybe_build_draft_sampler\(self\)",
        r"def _greedy_sample_from_vocab_parallel_head\(",
        r"hidden_states: torch\.Tensor",
        r"lm_head,",
        r"self\.draft_model = ",
        r"self\._target_worker = ",
        r"self\.block_size = ",
        r"_draft_sampler\.out\[",
        r"capture_tail_hooks",
        r"def forward_batch_generation\(",
        r"self\.draft_model_runner = ",
        r"draft_model_runner\.forward\(",
        r"is_verify=True",
        r"forward_mode\.is_extend\(\)",
        r"is_extend_in_batch",
    ],
    "sglang/srt/model_executor/model_runner.py": [r"class ModelRunner\b", r"    def forward\(\n\s+self,"],
    "sglang/srt/managers/tp_worker.py": [
        r"class TpModelWorker\b",
        r"def forward_batch_generation\(",
        r"is_verify: bool = False",
    ],
    "sglang/srt/model_executor/forward_batch_info.py": [r"def is_extend\(", r"def is_idle\("],
    "sglang/srt/models/registry.py": [
        r"def register\(\s*self, package_name: str, overwrite: bool = False, strict",
        r"ModelRegistry = _ModelRegistry\(\)",
    ],
    "sglang/srt/plugins/hook_registry.py": [r"class HookRegistry\b", r"AROUND = \"around\"", r"def register\("],
    "sglang/srt/layers/logits_processor.py": [r"class LogitsProcessorOutput\b"],
    "sglang/srt/runtime_context.py": [r"def get_parallel\(", r"def get_exec\("],
    # tensor parallelism: the target head's vocabulary shard and the group the ranks merge proposals through
    "sglang/srt/distributed/__init__.py": [r"from sglang\.srt\.distributed\.parallel_state import \*"],
    "sglang/srt/distributed/parallel_state.py": [
        r"def get_tp_group\(\)",
        r"def all_reduce\(self, input_: torch\.Tensor\) -> torch\.Tensor",
        r"def all_gather_into_tensor\(self, output: torch\.Tensor, input: torch\.Tensor\)",
        r"world_size",
    ],
    "sglang/srt/layers/vocab_parallel_embedding.py": [
        r"self\.shard_indices = ",
        r"org_vocab_start_index: int",
        r"def num_org_elements\(self\)",
        r"def num_added_elements\(self\)",
    ],
    # the config fields it reads (export writes them in DFlash's names)
    "sglang/srt/speculative/dflash_utils.py": [
        r"def parse_dflash_draft_config\b",
        r"mask_token_id",
        r"target_layer_ids",
        r"num_target_layers",
        r"block_size",
    ],
    # where a general plugin is found, and how a speculative algorithm is registered
    "sglang/srt/plugins/__init__.py": [r"GENERAL_PLUGINS_GROUP\s*=\s*\"sglang\.srt\.plugins\""],
    "sglang/srt/speculative/spec_info.py": [r"class SpeculativeAlgorithm\b", r"def register\b"],
}


# names the plugin uses only from a release on: DFLASH's candidate-selector contract (>= 0.5.23), through which
# SGLang walks DSpine's transition lattice itself (models/dspine_draft.py, core.DSpineSelector)
SINCE: dict[str, dict[str, list[str]]] = {
    "0.5.23": {
        "sglang/srt/models/dflash.py": [
            r"class CandidateSelector\b",
            r"def sample_path\(\s*self,\s*\*,\s*candidate_ids",
            r"greedy_mask",
            r"self\.candidate_selector: Optional\[nn\.Module\] = None",
            r"def build_lattice\(",
        ],
        "sglang/srt/speculative/dflash_worker_v2.py": [
            r"self\.selector = self\.draft_model\.candidate_selector",
            r"draft_model\.compute_candidates\(",
            r"draft_model\.candidate_selector\.build_lattice\(",
            r"self\.draft_model\.lm_head = lm_head",
            r"class _SelectorDraftSampler\b",
            r"self\.q_out",
            r"def _propose_selector_block\(",
        ],
    }
}


def names_for(version: str) -> dict[str, list[str]]:
    """NAMES plus what the plugin uses from releases up to `version`."""
    key = tuple(int(x) for x in version.split("."))
    out = {path: list(p) for path, p in NAMES.items()}
    for since, extra in SINCE.items():
        if tuple(int(x) for x in since.split(".")) <= key:
            for path, patterns in extra.items():
                out.setdefault(path, []).extend(patterns)
    return out


def missing_names(wheel: str | Path, version: str | None = None) -> dict[str, list[str]]:
    """{file: [patterns absent]} for one SGLang wheel (read as a zip; nothing is imported); `version` (else
    the wheel's file name) adds the names of SINCE that release."""
    version = version or Path(wheel).name.split("-")[1]
    out: dict[str, list[str]] = {}
    with zipfile.ZipFile(wheel) as z:
        present = set(z.namelist())
        for path, patterns in names_for(version).items():
            if path not in present:
                out[path] = ["<file missing>"]
                continue
            text = z.read(path).decode("utf-8", "replace")
            gone = [p for p in patterns if not re.search(p, text)]
            if gone:
                out[path] = gone
    return out
