"""The scheduler renders chat templates without transformers; transformers' own
apply_chat_template is the oracle."""
import pytest
from transformers import AutoTokenizer

from scheduler_svc.chat_template import ChatTemplate, ChatTemplateError

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
    assert ChatTemplate(tiny_model_dir).render(messages, add_generation_prompt, kwargs) == want


def test_a_template_that_raises_names_the_reason(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{% if messages[0].role != \'user\' %}{{ raise_exception(\'user first\') }}{% endif %}"}')
    with pytest.raises(ChatTemplateError, match="user first"):
        ChatTemplate(tmp_path).render([{"role": "assistant", "content": "x"}], True, {})


def test_a_model_without_a_template_is_named(tmp_path):
    with pytest.raises(ChatTemplateError, match=f"{tmp_path}.*no chat template"):
        ChatTemplate(tmp_path).render([{"role": "user", "content": "x"}], True, {})
