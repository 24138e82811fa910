"""The versions file the serving image's init container writes: parse and compare (pure)."""

import pytest

from kvoffload.engine import versions


def test_parse_a_real_pair():
    found = versions.parse('{"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"}')
    assert found == versions.EngineVersions(vllm="0.26.0", lmcache="0.5.3", torch="2.11.0+cu130")
    assert found.labels() == {"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"}


def test_a_package_the_image_lacks_is_reported_not_an_error():
    found = versions.parse('{"vllm": "0.27.1", "lmcache": null, "torch": "2.13.0"}')
    assert found.lmcache == versions.NOT_INSTALLED
    assert versions.parse("{}") == versions.EngineVersions("none", "none", "none")


@pytest.mark.parametrize("text, error", [
    ("", "not JSON"),
    ('{"vllm": "0.26.0"', "not JSON"),
    ('["0.26.0"]', "not a JSON object"),
    ('{"vllm": 0.26}', "vllm: 0.26 is not a version string"),
    ('{"lmcache": ""}', "lmcache: '' is not a version string"),
    ('{"torch": "' + "9" * 65 + '"}', "torch: "),
    ('{"vllm": "0.26.0\\n"}', "vllm: "),
])
def test_garbled_files_say_what_is_wrong(text, error):
    with pytest.raises(ValueError, match=error):
        versions.parse(text)


@pytest.mark.parametrize("rendered, running, same", [
    ("0.26.0", "0.26.0", True),
    ("0.26.0", "0.26.0+cu130", True),  # a local build of the same release
    ("2.11.0+cu130", "2.11.0", True),
    ("0.26.0", "0.27.1", False),
    ("0.5.3", "0.5.30", False),
    ("0.5.3", versions.NOT_INSTALLED, False),
])
def test_matches(rendered, running, same):
    assert versions.matches(rendered, running) is same

