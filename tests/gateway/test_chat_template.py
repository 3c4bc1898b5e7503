"""The gateway renders chat templates without transformers; transformers' own
apply_chat_template is the oracle."""
import pytest
from transformers import AutoTokenizer

from gateway_svc.errors import OpenAIError
from gateway_svc.model_files import ModelFiles

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode 你好 🙂?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
    [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nBecause."},
     {"role": "user", "content": "Sure?"}],
]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_rendering_equals_transformers(tiny_model_dir, hf, messages, add_generation_prompt, kwargs):
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ModelFiles(str(tiny_model_dir)).render_chat(messages, add_generation_prompt, kwargs) == want


def test_a_template_that_raises_is_a_400(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{% if messages[0].role != \'user\' %}{{ raise_exception(\'user first\') }}{% endif %}"}')
    with pytest.raises(OpenAIError) as raised:
        ModelFiles(str(tmp_path)).render_chat([{"role": "assistant", "content": "x"}], True, {})
    assert raised.value.status == 400 and "user first" in str(raised.value)


def test_missing_files_name_the_path_and_the_flag(tmp_path):
    with pytest.raises(OpenAIError) as raised:
        ModelFiles(str(tmp_path / "absent")).render_chat([{"role": "user", "content": "x"}], True, {})
    assert str(tmp_path / "absent") in str(raised.value) and "--tokenizer" in str(raised.value)
