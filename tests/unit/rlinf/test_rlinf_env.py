"""RLinf drop-in, item 3: path-like variables of ``env_configs`` are merged, not replaced.

The rules on their own; tests/system/test_rlinf_e2e.py checks them in real workers.
"""

from __future__ import annotations

import pytest

from aiorl.node.launch_env import merge_environment, merge_path_list, path_env_merge_mode

pytestmark = pytest.mark.timeout(10)


def test_merge_units() -> None:
    # RLinf's own examples: incoming first, duplicates removed, empties dropped.
    assert merge_path_list("/new:/existing/a", "/existing/a:/existing/b") == (
        "/new:/existing/a:/existing/b")
    assert merge_path_list("/custom/bin:/usr/bin", "/usr/bin:/bin") == "/custom/bin:/usr/bin:/bin"
    assert merge_path_list("::/a:", "") == "/a"
    inherited = {"PATH": "/usr/bin", "HTTP_PROXY": "http://old:8080", "CPATH": "/inc"}
    launch = {"PATH": "/x/bin", "HTTP_PROXY": "http://new:8080", "CPATH": "/inc2",
              "NEW_PATH_LIKE": "/q"}
    assert merge_environment(launch, inherited) == {
        "PATH": "/x/bin:/usr/bin", "HTTP_PROXY": "http://new:8080", "CPATH": "/inc2:/inc",
        "NEW_PATH_LIKE": "/q"}
    override = merge_environment({**launch, "AIORL_PATH_ENV_MERGE_MODE": "OVERRIDE"}, inherited)
    assert override["PATH"] == "/x/bin" and override["CPATH"] == "/inc2"
    # Extra names join the merged set; a bad mode falls back to append (RLinf does too).
    extra = merge_environment({"AIORL_PATH_LIKE_ENV_VARS": "MY_DIRS", "MY_DIRS": "/b"},
                              {"MY_DIRS": "/a"})
    assert extra["MY_DIRS"] == "/b:/a"
    assert path_env_merge_mode({}, {"AIORL_PATH_ENV_MERGE_MODE": "sideways"}) == "append"

