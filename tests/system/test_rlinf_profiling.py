"""RLinf drop-in, item 4: the ``profiling:`` section, parsed and rendered into commands.

The launch itself (a stand-in ``nsys`` on ``PATH``) is in tests/system/test_rlinf_e2e.py.
"""

from __future__ import annotations

import pytest

from aiorl.placement import ClusterSpec, NodePlacementStrategy, PlacementError, parse_profiling

pytestmark = pytest.mark.timeout(10)


def test_nsys_command_and_rlinf_aliases() -> None:
    config = parse_profiling({
        "backend": "nsight",  # RLinf's name
        "worker_groups": ["actor", "Rollout"],
        "options": {"t": "cuda,nvtx", "stop-on-range-end": True, "sample": "process-tree"},
        "flags": "python-backtrace",
        "output_dir": "/reports",
    })
    assert config is not None and config.backend == "nsys"
    assert config.options["capture-range-end"] == "stop"  # the alias, normalised
    assert config.profiles("actor") and config.profiles("rollout") and not config.profiles("env")
    launch = config.launch("actor:3")
    assert launch.argv == ("nsys", "profile", "--python-backtrace", "-t", "cuda,nvtx",
                           "--sample=process-tree", "--capture-range-end=stop",
                           "-o", "/reports/aiorl_profile_actor_3_%p")
    assert launch.env == {"AIORL_PROFILER": "nsys", "AIORL_PROFILE_OUTPUT_DIR": "/reports"}


def test_nsys_to_cli_tokens_renders_the_options_alone() -> None:
    # RLinf's NsightConfig.to_cli_tokens(): flags, then options, no "nsys profile".
    flags_only = parse_profiling({"backend": "nsight", "flags": ["python-backtrace"]})
    assert flags_only is not None and flags_only.to_cli_tokens() == ["--python-backtrace"]
    config = parse_profiling({"backend": "nsys", "flags": ["python-backtrace", "w"],
                              "options": {"t": "cuda,nvtx", "sample": "process-tree"}})
    assert config is not None
    assert config.to_cli_tokens() == ["--python-backtrace", "-w", "-t", "cuda,nvtx",
                                      "--sample=process-tree"]
    # default_output_prefix adds -o, as RLinf's does, unless the options name an output
    assert config.to_cli_tokens("/r/p")[-2:] == ["-o", "/r/p"]
    named = parse_profiling({"backend": "nsys", "options": {"output": "/mine"}})
    assert named is not None and named.to_cli_tokens("/r/p") == ["--output=/mine"]
    # launch() is "nsys profile" + the tokens with the worker's report prefix
    launch = config.launch("actor:0")
    assert launch.argv[:2] == ("nsys", "profile")
    assert list(launch.argv[2:]) == config.to_cli_tokens(launch.argv[-1])
    # rocprof-sys: RLinf's RocprofSysConfig.to_cli_tokens(), the whole prefix up to "--"
    roc = parse_profiling({"backend": "rocprof_sys", "args": {"F": "true"}})
    assert roc is not None and roc.to_cli_tokens() == ["rocprof-sys-python", "-F", "true", "--"]
    bare = parse_profiling({"backend": "rocprof_sys"})
    assert bare is not None and bare.to_cli_tokens() == ["rocprof-sys-python", "--"]


def test_steps_set_a_capture_range_unless_given() -> None:
    auto = parse_profiling({"backend": "nsys", "steps": [5, 10]})
    assert auto is not None
    assert auto.options == {"capture-range": "cudaProfilerApi", "capture-range-end": "stop"}
    assert auto.should_profile_step(5) and not auto.should_profile_step(7)
    assert auto.launch("a:0").env["AIORL_PROFILE_STEPS"] == "5,10"
    mine = parse_profiling({"backend": "nsys", "steps": [5],
                            "options": {"capture-range": "nvtx", "capture-range-end": "none"}})
    assert mine is not None and mine.options["capture-range"] == "nvtx"
    whole = parse_profiling({"backend": "nsys", "options": {"t": "cuda"}})
    assert whole is not None and "capture-range" not in whole.options
    assert whole.should_profile_step(100)
    off = parse_profiling({"backend": "nsys", "enabled": False, "worker_groups": "all"})
    assert off is not None and not off.profiles("actor") and not off.should_profile_step(5)


def test_rocprof_sys_command_and_env() -> None:
    config = parse_profiling({"backend": "rocprof-sys", "worker_groups": "all",
                              "args": {"F": True, "output-format": "json"},
                              "env": {"ROCPROFSYS_OUTPUT_PATH": "/custom"},
                              "output_dir": "/traces"})
    assert config is not None and config.profiles("anything")
    launch = config.launch("actor:0")
    assert launch.argv == ("rocprof-sys-python", "-F", "true", "--output-format=json", "--")
    assert launch.env["ROCPROFSYS_OUTPUT_PATH"] == "/custom"  # the user's setting wins
    assert launch.env["ROCPROFSYS_OUTPUT_PREFIX"] == "aiorl_profile_actor_0_"


def test_cluster_section_selects_groups_node_group_section_selects_all() -> None:
    spec = ClusterSpec.from_config({
        "num_nodes": 2,
        "profiling": {"backend": "nsys"},  # cluster level without worker_groups: nothing
        "node_groups": [{"label": "gpu", "node_ranks": 1,
                         "profiling": {"backend": "rocprof_sys"}}],
    })
    [on_cluster] = NodePlacementStrategy([0]).get_placement(spec)
    assert on_cluster.profiler_launch("actor") is None
    [on_gpu] = NodePlacementStrategy([0], node_group="gpu").get_placement(spec)
    launch = on_gpu.profiler_launch("actor")
    assert launch is not None and launch.argv[0] == "rocprof-sys-python"


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ({"worker_groups": ["actor"]}, "backend must be specified"),
        ({"backend": "vtune"}, "Unknown profiling backend 'vtune'"),
        ({"backend": "nsys", "flags": ["python-backtrace"],
          "options": {"python-backtrace": "cuda"}},
         "Got duplicates: ['python-backtrace']"),
        ({"backend": "nsys", "options": {"stop-on-range-end": True, "capture-range-end": "stop"}},
         "must not specify both 'stop-on-range-end' and 'capture-range-end'"),
        ({"backend": "nsys", "options": {"o": "a", "output": "b"}}, "both 'o' and 'output'"),
        ({"backend": "nsys", "steps": [3, -1]}, "steps must be non-negative integers"),
        ({"backend": "nsys", "steps": 3}, "steps must be a list of integers"),
        ({"backend": "nsys", "options": ["BAD"]}, "options must be a dictionary"),
        ({"backend": "rocprof-sys", "args": ["bad"]}, "args must be a dictionary"),
        ({"backend": "rocprof-sys", "env": "X=1"}, "env must be a dictionary"),
        ({"backend": "nsys", "args": {"F": "true"}}, "args belong(s) to the other backend"),
        ({"backend": "nsys", "enable": True}, "unknown key(s) enable"),
        ({"backend": "nsys", "enabled": "yes"}, "enabled must be true or false"),
        (["nsys"], "expected a mapping"),
    ],
)
def test_invalid_sections(section: object, fragment: str) -> None:
    with pytest.raises(PlacementError) as info:
        ClusterSpec.from_config({"num_nodes": 1, "profiling": section})
    assert fragment in str(info.value)
    assert str(info.value).startswith("profiling")


def test_node_group_section_errors_name_the_group() -> None:
    with pytest.raises(PlacementError, match="node group 'gpu' profiling: Unknown profiling"):
        ClusterSpec.from_config({"num_nodes": 1, "node_groups": [
            {"label": "gpu", "node_ranks": 0, "profiling": {"backend": "perf"}}]})
