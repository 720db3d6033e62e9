"""`weft up --model DIR` where DIR's config.json is broken: the router died at start with a
bare "JSONDecodeError: Expecting property name …", naming neither the file nor the flag.
The launcher checks the checkpoint's small JSON files before starting anything."""
import json

from weft.launcher.startup_checks import check_model_dir


def test_a_corrupt_config_json_is_named_with_the_flag(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": "x",')
    problem = check_model_dir(str(tmp_path))
    assert problem is not None and problem.startswith(f"{tmp_path / 'config.json'} is not valid JSON")
    assert problem.endswith("(--model)")


def test_a_config_that_is_not_an_object_or_not_utf8_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    assert check_model_dir(str(tmp_path)) == f"{tmp_path / 'config.json'} is not a JSON object (--model)"
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    assert "config.json cannot be read" in check_model_dir(str(tmp_path))


def test_valid_or_absent_small_files_pass(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert check_model_dir(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text("")
    assert "tokenizer_config.json is not valid JSON" in check_model_dir(str(tmp_path))
