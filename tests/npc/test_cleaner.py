"""The cleaner turns raw model output into the line an NPC speaks (replies.md "Cleaning")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bridge.npc.cleaner import Cleaned, clean
from bridge.npc.streaming import has_enough, split_inline_memory

OWN = ("カフェのみのり", "みのり")
OTHERS = ("旅人1", "映画館のあおい", "あおい", "旅館のふみ", "ふみ")


def _clean(raw: str, *, max_sentences: int = 2, max_chars: int = 90) -> Cleaned:
    return clean(raw, own_names=OWN, other_speakers=OTHERS, max_sentences=max_sentences, max_chars=max_chars)


def _enough(raw: str, max_sentences: int = 2) -> bool:
    return has_enough(raw, own_names=OWN, other_speakers=OTHERS, max_sentences=max_sentences)


# /work/shared/examples/raw-replies.jsonl: real output of small models, with the expected result.
RAW_REPLY_EXAMPLES = [
    (
        "[relaxed]おはようございます！いらっしゃいませ。今日も映画を観るのですね？上映中の作品は何になさいますか？"
        "<assistant [neutral]どうぞこちらへ。客席まで案内しますね。",
        "おはようございます！いらっしゃいませ。",
        "relaxed",
    ),
    (
        "[relaxed]やっぱり朝から降り続くみたいですね。傘を持って来て良かったですよ。 <コーヒーを運びますね>",
        "やっぱり朝から降り続くみたいですね。傘を持って来て良かったですよ。",
        "relaxed",
    ),
    (
        "[relaxed]おかえりなさいませ。お越しいただきありがとうございます。山の麓で降り立つと、涼やかな風が"
        "心地よい季節です。今日はどうぞごゆっくりとお過ごしくださいね。",
        "おかえりなさいませ。お越しいただきありがとうございます。",
        "relaxed",
    ),
    ("いらっしゃいませ。<|assistant|>ご注文はお決まりですか？", "いらっしゃいませ。", "neutral"),
    ("＜にっこり＞本日のおすすめはチーズケーキですよ。", "本日のおすすめはチーズケーキですよ。", "neutral"),
    (
        "[happy][motion:bow]ありがとうございます！またお越しくださいね。",
        "ありがとうございます！またお越しくださいね。",
        "happy",
    ),
    ("みのり：紅茶ですね、すぐにお持ちしますね。", "紅茶ですね、すぐにお持ちしますね。", "neutral"),
    ("「いらっしゃいませ。ごゆっくりどうぞ。」", "いらっしゃいませ。ごゆっくりどうぞ。", "neutral"),
    (
        "ごゆっくりどうぞ。<end_of_turn>\n<start_of_turn>user\nありがとう<end_of_turn>",
        "ごゆっくりどうぞ。",
        "neutral",
    ),
    ("はい、上映は十九時からです。 <お客様を客席へ案内する", "はい、上映は十九時からです。", "neutral"),
]


@pytest.mark.parametrize(("raw", "text", "emotion"), RAW_REPLY_EXAMPLES)
def test_real_model_output_is_cleaned_as_the_examples_say(raw: str, text: str, emotion: str) -> None:
    result = _clean(raw)
    assert (result.text, result.emotion) == (text, emotion)


SHARED_EXAMPLES = Path("/work/shared/examples/raw-replies.jsonl")


@pytest.mark.skipif(not SHARED_EXAMPLES.is_file(), reason="the shared examples are not on this machine")
def test_every_shared_raw_reply_example_passes() -> None:
    # The shared file may grow: every example in it must pass, not only the copies above.
    for line in SHARED_EXAMPLES.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        example = json.loads(line)
        result = _clean(example["raw"])
        assert (result.text, result.emotion) == (example["text"], example["emotion"]), example["note"]


TEMPLATE_MARKERS = [
    ("はい。<|im_end|>\n<|im_start|>user\nどうも", "はい。"),
    ("はい。<user>どうも", "はい。"),
    ("はい。<system>ルール", "はい。"),
    ("はい。</s><s>[INST] 次 [/INST]", "はい。"),
    ("はい。[INST] 次", "はい。"),
    ("はい。<<SYS>>ルール", "はい。"),
    ("はい。<Assistant>どうぞ", "はい。"),
    ("はい。<start_of_turn>model\nどうぞ", "はい。"),
]


@pytest.mark.parametrize(("raw", "text"), TEMPLATE_MARKERS)
def test_everything_from_a_template_marker_on_is_cut(raw: str, text: str) -> None:
    assert _clean(raw).text == text


ROLE_HEADERS = [
    ("assistant\nいらっしゃいませ。", "いらっしゃいませ。"),
    ("Assistant:\nいらっしゃいませ。", "いらっしゃいませ。"),
    ("Assistant:いらっしゃいませ。", "いらっしゃいませ。"),
    ("  model\nはい、どうぞ。", "はい、どうぞ。"),
    ("assistant", ""),
]


@pytest.mark.parametrize(("raw", "text"), ROLE_HEADERS)
def test_a_role_header_at_the_start_is_removed_not_cut_after(raw: str, text: str) -> None:
    assert _clean(raw).text == text


def test_a_role_word_inside_the_text_is_kept() -> None:
    assert _clean("Model trains are fun!").text == "Model trains are fun!"


OTHER_SPEAKER_LINES = [
    ("いらっしゃいませ。\nUser: コーヒーください", "いらっしゃいませ。"),
    ("いらっしゃいませ。\nuser：コーヒーください", "いらっしゃいませ。"),
    ("いらっしゃいませ。ユーザー：こんにちは", "いらっしゃいませ。"),
    ("いらっしゃいませ。\nプレイヤー：こんにちは", "いらっしゃいませ。"),
    ("いらっしゃいませ。\n旅人1：コーヒーください。\nみのり：はい。", "いらっしゃいませ。"),
    ("いらっしゃいませ。旅人1: こんにちは", "いらっしゃいませ。"),
    ("こちらへどうぞ。\nあおい：映画館へようこそ！", "こちらへどうぞ。"),
    ("こちらへどうぞ。映画館のあおい：ようこそ！", "こちらへどうぞ。"),
    ("こちらへどうぞ。\n[happy]あおい：ようこそ！", "こちらへどうぞ。"),
    ("こちらへどうぞ。あおいさん：ようこそ！", "こちらへどうぞ。"),
    ("User: こんにちは", ""),
]


@pytest.mark.parametrize(("raw", "text"), OTHER_SPEAKER_LINES)
def test_another_speakers_line_is_cut(raw: str, text: str) -> None:
    assert _clean(raw).text == text


def test_a_name_followed_by_a_colon_inside_a_sentence_is_kept() -> None:
    assert _clean("上映時間：19時からです。").text == "上映時間：19時からです。"


def test_the_player_name_is_an_other_speaker_only_when_passed() -> None:
    raw = "はい。\nたろう：ありがとう"
    assert _clean(raw).text == "はい。たろう：ありがとう"
    cut = clean(raw, own_names=OWN, other_speakers=("たろう",), max_sentences=2, max_chars=90)
    assert cut.text == "はい。"


@pytest.mark.parametrize(
    ("name", "raw", "text"),
    [
        ("Dr. Kato", "Here you are. Dr. Kato: Thanks!", "Here you are."),  # a name holding a sentence end
        ("Kato", "Yes. Hi. Kato: Thanks!", "Yes. Hi."),  # the label starts at a later boundary
        ("ken", "はい。\nKEN さん : どうも", "はい。"),
        ("さくらさん", "はい。さくらさん：どうも", "はい。"),  # the honorific is part of the name
        ("たろう", "はい。じろう：どうも。", "はい。じろう：どうも。"),  # somebody else's name is text
    ],
)
def test_a_players_label_is_found_whatever_the_name_holds(name: str, raw: str, text: str) -> None:
    result = clean(raw, own_names=OWN, other_speakers=(name,), max_sentences=3, max_chars=90)
    assert result.text == text


def test_a_player_named_like_the_npc_does_not_cut_the_npcs_own_prefix() -> None:
    result = clean("みのり：はい、どうぞ。", own_names=OWN, other_speakers=("みのり",), max_sentences=2, max_chars=90)
    assert result.text == "はい、どうぞ。"


EMOTIONS = [
    ("[happy]はい。", "happy"),
    ("[Happy]はい。", "happy"),
    ("[ SAD ]残念です。", "sad"),
    ("[angry]もう！", "angry"),
    ("[relaxed]ふう。", "relaxed"),
    ("[surprised]えっ！", "surprised"),
    ("[neutral]はい。", "neutral"),
    ("[joy]うれしいです。", "happy"),
    ("[sorrow]残念です。", "sad"),
    ("[fun]楽しいですね。", "relaxed"),
    ("[motion:bow][angry]もう！", "angry"),
    ("[happy]はい。[sad]でも。", "happy"),
    ("[excited]はい。", "neutral"),
    ("はい。", "neutral"),
    ("はい。[surprised]", "surprised"),
]


@pytest.mark.parametrize(("raw", "emotion"), EMOTIONS)
def test_the_first_emotion_tag_gives_the_emotion(raw: str, emotion: str) -> None:
    assert _clean(raw).emotion == emotion


@pytest.mark.parametrize(
    "raw",
    ["[happy]はい。", "はい。[motion:bow]", "[motion:bow][happy]は[wink]い。", "はい。[surpri"],
)
def test_every_tag_is_removed(raw: str) -> None:
    assert _clean(raw).text == "はい。"


STAGE_DIRECTIONS = [
    ("<にっこり＞いらっしゃいませ。", "いらっしゃいませ。"),
    ("＜にっこり>いらっしゃいませ。", "いらっしゃいませ。"),
    ("いらっしゃいませ。<お辞儀をする", "いらっしゃいませ。"),
    ("いらっしゃいませ。＜お辞儀をする", "いらっしゃいませ。"),
    ("いらっしゃいませ。<a<b>c>ごゆっくり。", "いらっしゃいませ。ごゆっくり。"),
    ("*微笑む*いらっしゃいませ。", "いらっしゃいませ。"),
    ("いらっしゃいませ。＊微笑む＊", "いらっしゃいませ。"),
    ("いらっしゃいませ。*微笑む", "いらっしゃいませ。"),
    ("**深煎り**がおすすめです。", "深煎りがおすすめです。"),
    ("（微笑む）いらっしゃいませ。", "いらっしゃいませ。"),
    ("(微笑む)いらっしゃいませ。", "いらっしゃいませ。"),
    ("（微笑む）（お辞儀）いらっしゃいませ。", "いらっしゃいませ。"),
    ("いらっしゃいませ。（微笑む）", "いらっしゃいませ。"),
    ("楽しいですね（笑）", "楽しいですね"),
    ("いらっしゃいませ。（微笑む）ごゆっくりどうぞ。", "いらっしゃいませ。ごゆっくりどうぞ。"),
    ("いらっしゃいませ。（微笑んで", "いらっしゃいませ。"),
    ("<think>ユーザーは挨拶している</think>いらっしゃいませ。", "いらっしゃいませ。"),
    ("<コーヒーを運ぶ>", ""),
    ("（微笑む）", ""),
    ("*bows*", ""),
]


@pytest.mark.parametrize(("raw", "text"), STAGE_DIRECTIONS)
def test_stage_directions_are_removed(raw: str, text: str) -> None:
    assert _clean(raw).text == text


@pytest.mark.parametrize(
    "raw",
    ["映画（字幕版）は19時からです。", "お会計は500円です（税込）。", "新作（吹替）と旧作があります。"],
)
def test_parentheses_inside_a_sentence_stay(raw: str) -> None:
    assert _clean(raw).text == raw


PREFIXES_AND_QUOTES = [
    ("みのり：紅茶ですね。", "紅茶ですね。"),
    ("みのり: 紅茶ですね。", "紅茶ですね。"),
    ("カフェのみのり：紅茶ですね。", "紅茶ですね。"),
    ("  みのり ： 紅茶ですね。", "紅茶ですね。"),
    ("みのり：「紅茶ですね。」", "紅茶ですね。"),
    ("『ごゆっくりどうぞ。』", "ごゆっくりどうぞ。"),
    ('"Welcome!"', "Welcome!"),
    ("“いらっしゃいませ。”", "いらっしゃいませ。"),
    ("「はい」と「いいえ」があります。", "「はい」と「いいえ」があります。"),
    ("「いらっしゃいませ。」\n「ごゆっくり。」", "いらっしゃいませ。ごゆっくり。"),
    ("みのりさんのおすすめです。", "みのりさんのおすすめです。"),
]


@pytest.mark.parametrize(("raw", "text"), PREFIXES_AND_QUOTES)
def test_own_prefix_and_whole_line_quotes_are_removed(raw: str, text: str) -> None:
    assert _clean(raw).text == text


WHITESPACE = [
    ("いらっしゃいませ。\n\n  ごゆっくりどうぞ。", "いらっしゃいませ。ごゆっくりどうぞ。"),
    ("  はい、 どうぞ。 ", "はい、どうぞ。"),
    ("Hello ,  welcome !", "Hello, welcome!"),
    ("Hello\nthere.", "Hello there."),
]


@pytest.mark.parametrize(("raw", "text"), WHITESPACE)
def test_whitespace_is_tidied(raw: str, text: str) -> None:
    assert _clean(raw).text == text


SENTENCES = [
    # (raw, max_sentences, text)
    ("ええと……そうですね。少々お待ちください。次です。", 2, "ええと……そうですね。少々お待ちください。"),
    ("ええと…はい。まだです。", 1, "ええと…はい。"),
    ("本当ですか？」ええ。そうです。", 1, "本当ですか？"),
    ("「本当ですか？」と聞かれました。次です。", 1, "「本当ですか？」と聞かれました。"),
    ("本当ですか！？ はい。", 1, "本当ですか！？"),
    ("Hello! How are you? Fine.", 2, "Hello! How are you?"),
    ("Welcome to the cafe. Please take a seat. Enjoy.", 2, "Welcome to the cafe. Please take a seat."),
    ("It costs 3.5 coins... maybe. Sure.", 1, "It costs 3.5 coins... maybe."),
    ("いらっしゃいませ。ごゆっくり", 2, "いらっしゃいませ。ごゆっくり"),
    ("いらっしゃいませ。ごゆっくり", 1, "いらっしゃいませ。"),
    ("「いらっしゃいませ。ごゆっくりどうぞ。", 1, "いらっしゃいませ。"),
    ("", 2, ""),
]


@pytest.mark.parametrize(("raw", "max_sentences", "text"), SENTENCES)
def test_the_first_sentences_are_kept(raw: str, max_sentences: int, text: str) -> None:
    assert _clean(raw, max_sentences=max_sentences).text == text


LONG = "こちらは当店でいちばん人気のある深煎りのブレンドで、香りがとても豊かなのでぜひ一度お試しください。"

MAX_CHARS = [
    # (raw, max_chars, text)
    (LONG, 40, "こちらは当店でいちばん人気のある深煎りのブレンドで"),
    (
        "こちらは当店でいちばん人気のある深煎りのブレンドでございます。",
        20,
        "こちらは当店でいちばん人気のある深煎りの",
    ),
    ("Our house blend is the most popular one here today.", 20, "Our house blend is"),
    ("いらっしゃいませ。こちらは当店でいちばん人気のある深煎りのブレンドです。", 20, "いらっしゃいませ。"),
    ("はい、そうです。", 90, "はい、そうです。"),
]


@pytest.mark.parametrize(("raw", "max_chars", "text"), MAX_CHARS)
def test_an_over_long_reply_is_cut_at_a_pause_within_the_limit(raw: str, max_chars: int, text: str) -> None:
    result = _clean(raw, max_chars=max_chars)
    assert result.text == text
    assert len(result.text) <= max_chars


HAS_ENOUGH = [
    # (raw so far, max_sentences, enough)
    ("いらっしゃいませ", 1, False),
    ("いらっしゃいませ。", 1, False),  # a 」 may still follow the 。
    ("いらっしゃいませ。」", 1, False),
    ("いらっしゃいませ。 ", 1, False),
    ("いらっしゃいませ。」ど", 1, True),
    ("いらっしゃいませ。ご", 1, True),
    ("いらっしゃいませ。ご", 2, False),
    ("いらっしゃいませ。ごゆっくり。", 2, False),
    ("いらっしゃいませ。ごゆっくり。今", 2, True),
    ("ですね。<コーヒーを運びますね", 1, False),  # "ですね。<…>」" would still join the sentence
    ("ですね。<コーヒーを運びますね>ど", 1, True),
    ("ですね。<コーヒーを運びますね。", 2, False),  # the sentence inside the open < does not count
    ("ですね。<コーヒーを運びますね>", 2, False),
    ("ですね。<コーヒーを運びますね>は", 2, False),
    ("ですね。（微笑んで。", 2, False),
    ("[happy]", 1, False),
    ("<assist", 1, False),
    ("ですね。<|", 2, True),  # a template marker: everything after is cut
    ("ですね。<assistant", 2, True),
    ("ですね。\nUser:", 3, True),
    ("ですね。\nUser", 3, False),
    ("ですね。\n旅人1：", 3, True),
    ("「本当ですか？」と", 1, False),
    ("Hello. How", 1, True),
    ("Hello.", 1, False),
]


@pytest.mark.parametrize(("raw", "max_sentences", "enough"), HAS_ENOUGH)
def test_streaming_stops_once_enough_complete_sentences_or_a_cut_point_arrived(
    raw: str, max_sentences: int, enough: bool
) -> None:
    assert _enough(raw, max_sentences) is enough


@pytest.mark.parametrize(
    ("partial", "text"),
    [
        ("はい。<assist", "はい。"),
        ("はい。<|im_e", "はい。"),
        ("はい。<end_of_tu", "はい。"),
        ("はい。</", "はい。"),
        ("はい。[IN", "はい。"),
        ("はい。<<SY", "はい。"),
        ("はい。[hap", "はい。"),
    ],
)
def test_a_half_received_marker_is_never_spoken(partial: str, text: str) -> None:
    assert _clean(partial).text == text


def test_what_has_enough_stops_at_cleans_to_the_kept_sentences() -> None:
    stream = "[happy]いらっしゃいませ！ごゆっくりどうぞ。今日は"
    so_far = ""
    for char in stream:
        so_far += char
        if _enough(so_far):
            break
    assert so_far.endswith("今")
    assert _clean(so_far) == Cleaned(text="いらっしゃいませ！ごゆっくりどうぞ。", emotion="happy")


def test_the_quick_test_before_has_enough_never_changes_its_answer() -> None:
    from bridge.npc.streaming import final_sentences

    raws = [raw for raw, _, _ in RAW_REPLY_EXAMPLES] + [raw for raw, _ in OTHER_SPEAKER_LINES]
    raws += ["はい。[INST] 次の", "はい。[inst]", "Sure. Here you go. More", "「はい！」と。次", "紅茶\n# 見出し"]
    checked = 0
    for raw in raws:
        for end in range(1, len(raw) + 1):
            for max_sentences in (1, 2, 3):
                for max_chars in (0, 12):
                    options = {"own_names": OWN, "other_speakers": OTHERS, "max_sentences": max_sentences}
                    slow = final_sentences(raw[:end], max_chars=max_chars, **options).complete
                    assert has_enough(raw[:end], max_chars=max_chars, **options) == slow, (raw[:end], options)
                    checked += 1
    assert checked > 2000


INLINE_MEMORY = [
    (
        "いらっしゃいませ。<memory>\n- ユーザーは紅茶が好き\n\n- ユーザーは猫を飼っている\n</memory>",
        "いらっしゃいませ。",
        ["ユーザーは紅茶が好き", "ユーザーは猫を飼っている"],
    ),
    ("おかえり！<MEMORY>ユーザーは来週旅行に行く</Memory>", "おかえり！", ["ユーザーは来週旅行に行く"]),
    ("おかえり！\n<memory>\n- ユーザーは紅茶", "おかえり！\n", ["ユーザーは紅茶"]),
    ("おかえり！<memory></memory>", "おかえり！", []),
    ("おかえり！", "おかえり！", []),
    (
        "おかえり！<memory>・ユーザーは犬派\n1. ユーザーは朝型</memory>またね。",
        "おかえり！またね。",
        ["ユーザーは犬派", "ユーザーは朝型"],
    ),
]


@pytest.mark.parametrize(("raw", "spoken", "memories"), INLINE_MEMORY)
def test_inline_memory_is_split_from_the_spoken_part(raw: str, spoken: str, memories: list[str]) -> None:
    assert split_inline_memory(raw) == (spoken, memories)


def test_inline_memory_never_reaches_the_spoken_line() -> None:
    spoken, memories = split_inline_memory(
        "[happy]おかえり！今日はどうだった？<memory>\n- ユーザーは紅茶が好き\n</memory>"
    )
    assert _clean(spoken) == Cleaned(text="おかえり！今日はどうだった？", emotion="happy")
    assert memories == ["ユーザーは紅茶が好き"]


# --- prompt echo seen from a real small model (Gemma 3 270M in the e2e tests) ----------------------


def test_markdown_heading_is_a_cut_point() -> None:
    raw = "あなたもこの紅茶が好きなんですね。\n# 話し方のルール\n- 日本語で答える。"
    assert _clean(raw).text == "あなたもこの紅茶が好きなんですね。"


def test_heading_stops_the_stream() -> None:
    assert has_enough("紅茶ですね\n# 話し方", own_names=OWN, other_speakers=(), max_sentences=2)


def test_list_markers_at_line_starts_are_removed() -> None:
    assert _clean("- 紅茶ですね。\n・おいしいですよ。").text == "紅茶ですね。おいしいですよ。"


def test_hash_inside_a_sentence_is_not_a_heading() -> None:
    assert _clean("今日の席は#3番です。").text == "今日の席は#3番です。"
