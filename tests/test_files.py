"""files.py: the one JSON-object reader names the file (and line) for every way a file can be broken."""

import pytest

from diffusion_embedder.files import find_file, read_json_object, read_optional_json_object


class Custom(ValueError):
    pass


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{\n  "a": 1,\n  "b" 2\n}', r"x.json:3: not valid JSON \(line 3, column 7"),
        (b"[1, 2]", r"x.json: expected a JSON object, got list"),
        (b'{"a": "\xff"}', r"x.json: not UTF-8 text"),
    ],
)
def test_broken_file_is_named_with_its_line(tmp_path, content, expected):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(Custom, match=expected):
        read_json_object(path, Custom)


def test_missing_file_and_folder_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"nothere.json: file not found"):
        read_json_object(tmp_path / "nothere.json")
    with pytest.raises(ValueError, match=r"is a folder"):
        read_json_object(tmp_path)
    assert read_optional_json_object(tmp_path / "nothere.json") == {}
    assert read_optional_json_object(None) == {}


def test_find_file_in_a_local_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert find_file(str(tmp_path), "config.json") == str(tmp_path / "config.json")
    assert find_file(str(tmp_path), "other.json") is None
