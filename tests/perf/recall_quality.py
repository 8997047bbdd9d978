"""Benchmark part "recall" (issue 12): is the memory a line is about in the prompt, and what recall costs.

    .venv/bin/python -m tests.perf.recall_quality [--files N] [--seed S]
    .venv/bin/python -m tests.perf.bench --part 5

Generated memory files of 60 memories each (a random 60 of `TOPICS`, in random order, one a day) and,
for each file, one line about one of its memories, the memory chosen uniformly among the 60. Scored:
"the memory the line is about is in the prompt", for the newest-10 rule (the bridge before issue 12)
and for `bridge.memory.recall.recall` with the default settings (10 in all, the newest 3 always).
Three sets of lines:
- **shared word**: the line shares the topic's word with the memory (`盆栽の枝がのびすぎちゃって` /
  `ユーザーは盆栽を育てている`), the way the public examples do;
- **public examples**: the 12 cases of the shared `recall.jsonl` (copied to tests/memory/);
- **paraphrase**: the line names the topic with another word (`ワンちゃん` for `柴犬`): what lexical
  recall cannot find, shown so the figure is not read as more than it is.
Time: `recall()` per reply on a 60-memory file, with the NPC's index cached (every reply but the first
after a change) and rebuilt (the first reply after an extraction changed the memories), in µs.
Goal: shared word ≥ 90 % where newest-10 gets ~15 %; recall well under 1 ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from bridge.memory import recall as recall_module
from bridge.memory.models import Memory
from bridge.memory.recall import recall

EXAMPLES = Path(__file__).resolve().parent.parent / "memory" / "recall.jsonl"
JST = timezone(timedelta(hours=9))
MEMORIES_PER_FILE = 60
RECALL = 10
RECALL_RECENT = 3
GOAL_PERCENT = 90.0
SUBJECT = "ユーザー"

# memory | a line that shares its word | a line that names it with another word ("" when none)
TOPICS = """
ユーザーは盆栽を育てている|最近、盆栽の枝がのびすぎちゃってさ|
ユーザーはカヌーで川下りをするのが趣味|週末はカヌーを出すつもり|今度の休みは川でパドルを漕いでくるよ
ユーザーは柴犬を飼っている|うちの柴犬がまた脱走しちゃって|うちのワンちゃんがまた脱走しちゃって
ユーザーは毎朝ジョギングをしている|今朝のジョギング、雨で中止になっちゃった|今朝は雨で走れなかったんだ
ユーザーはチェロを習っている|チェロの発表会が近いんだ|
ユーザーは北海道の出身|北海道はもう雪が降ってるらしいよ|地元の札幌はもう雪だって
ユーザーは辛いカレーが好き|今日のまかないってカレーだったりする？|激辛のスパイス料理が食べたいな
ユーザーはプログラマーとして働いている|プログラマーって肩がこるんだよね|コードを書いてると肩がこるんだよね
ユーザーは将棋が得意|将棋で三連敗しちゃった|
ユーザーは猫アレルギーがある|猫のいるカフェってどう思う？アレルギーがあってさ|
ユーザーは来月に引っ越しを予定している|引っ越しの荷造りが全然終わらない|新しい部屋の荷造りが全然終わらない
ユーザーはサーフィンを始めたばかり|サーフィンでやっと波に乗れたよ|やっとボードの上に立てたよ
ユーザーは陶芸教室に通っている|陶芸でお茶碗を焼いてみたんだ|ろくろで器を作ってみたんだ
ユーザーは囲碁を打つ|囲碁の大会に出ることになった|
ユーザーは渓流釣りが好き|この前の釣りでイワナが釣れたよ|
ユーザーは編み物が得意|冬に向けて編み物を始めようかな|マフラーを毛糸で作ってるんだ
ユーザーは書道を習っている|書道の先生にほめられたんだ|筆で字を書くのって落ち着くよね
ユーザーはヨガ教室に通っている|ヨガのおかげで体がやわらかくなってきた|
ユーザーはボルダリングにはまっている|ボルダリングのジムに新しい課題が出たんだ|
ユーザーはスノーボードが得意|今年もスノーボードに行きたいな|
ユーザーは卓球部だった|卓球のラケットを新しくしたよ|
ユーザーは水泳を習っている|水泳でやっと二百メートル泳げた|プールでやっと二百メートル泳げた
ユーザーはロードバイクに乗っている|ロードバイクで峠を越えてきたんだ|
ユーザーは俳句を作るのが趣味|今日いい俳句を思いついたんだ|
ユーザーは落語を聞きに行く|落語の寄席に行ってきたよ|
ユーザーはピアノを弾く|ピアノの練習をさぼっちゃった|
ユーザーはギターを弾き語りする|ギターの弦が切れちゃってさ|
ユーザーは社交ダンスを習っている|ダンスのステップがむずかしくて|
ユーザーはパン作りにはまっている|パンがうまくふくらまなかったんだ|
ユーザーは熱帯魚を飼っている|熱帯魚の水槽を掃除しなきゃ|
ユーザーはインコを飼っている|インコがしゃべるようになったよ|
ユーザーはハムスターを二匹飼っている|ハムスターが回し車で遊んでるんだ|
ユーザーはうさぎを飼っている|うさぎの爪切りって大変なんだよ|
ユーザーは日本酒が好き|おいしい日本酒の店を見つけたよ|
ユーザーはワインに詳しい|このあいだのワイン、すごくよかった|
ユーザーは抹茶のお菓子が好き|抹茶のパフェを食べに行きたいな|
ユーザーはラーメンの食べ歩きをしている|駅前のラーメン屋が閉店しちゃった|
ユーザーはお寿司が好物|回転寿司でいっぱい食べちゃった|
ユーザーは蕎麦打ちを習っている|蕎麦打ちで手がつかれたよ|
ユーザーは餃子をよく作る|餃子を百個包んだんだ|
ユーザーは温泉めぐりが好き|次の連休は温泉に行こうかな|
ユーザーはキャンプ用品を集めている|キャンプ用のランタンを買ったよ|
ユーザーは沖縄に住んでいたことがある|沖縄の海がなつかしいな|
ユーザーは京都の大学に通っていた|京都の紅葉って今が見ごろかな|
ユーザーは台湾旅行が好き|台湾の夜市にまた行きたい|
ユーザーは看護師として夜勤をしている|今週は夜勤が続いてるんだ|
ユーザーは保育士をしている|保育園の遠足の準備で忙しくて|
ユーザーは花粉症がひどい|花粉がつらい季節になってきた|
ユーザーは資格試験の勉強をしている|試験まであと一か月なんだ|
ユーザーはマラソン大会に出るため練習している|マラソンの練習で足が痛くて|
ユーザーは筋トレが日課|筋トレでベンチプレスが上がったよ|
ユーザーは星を見るのが好き|流れ星を見に行ってきたよ|
ユーザーは古いカメラを集めている|フィルムカメラを修理に出したんだ|
ユーザーはプラモデルを作る|プラモデルの塗装がうまくいかなくて|
ユーザーは妹がいる|妹が結婚するんだ|
ユーザーは祖母の家によく行く|祖母の家で柿をもらったよ|おばあちゃんちで柿をもらったよ
ユーザーは恋愛映画が好き|泣ける映画ってなにかある？|
ユーザーはミステリー小説をよく読む|ミステリーの新刊、犯人が意外だった|
ユーザーは水族館の年間パスを持っている|水族館のペンギンが可愛くてさ|
ユーザーは電車で通勤している|電車が遅れて大変だったよ|
ユーザーは家庭菜園でトマトを育てている|トマトが赤くなってきたよ|
ユーザーは歌舞伎が好き|歌舞伎座の新しい演目を見てきた|
ユーザーはテニススクールに通っている|テニスでサーブが入らなくて|
ユーザーは紅茶が好き|おいしい紅茶の淹れ方ってある？|
ユーザーはチーズケーキが好き|チーズケーキ、今日はありますか？|
"""


@dataclass(frozen=True)
class Topic:
    memory: str
    line: str
    paraphrase: str


@dataclass(frozen=True)
class Case:
    memories: list[Memory]
    line: str
    expect: str


def topics() -> list[Topic]:
    return [Topic(*row.split("|")) for row in TOPICS.strip().splitlines()]


def generated(count: int, seed: int, *, paraphrase: bool = False) -> list[Case]:
    """`count` memory files of 60, each with a line about one memory chosen uniformly among them."""
    rng = random.Random(seed)
    pool = topics()
    cases: list[Case] = []
    start = datetime(2026, 6, 1, 20, 0, tzinfo=JST)
    while len(cases) < count:
        chosen = rng.sample(pool, MEMORIES_PER_FILE)
        memories = [Memory(text=t.memory, heard_at=start + timedelta(days=n)) for n, t in enumerate(chosen)]
        about = rng.choice([t for t in chosen if t.paraphrase] if paraphrase else chosen)
        cases.append(Case(memories, about.paraphrase if paraphrase else about.line, about.memory))
    return cases


def public_examples() -> list[Case]:
    cases: list[Case] = []
    for line in EXAMPLES.read_text(encoding="utf-8").splitlines():
        data = json.loads(line)
        memories = [Memory.model_validate(m) for m in data["memories"]]
        cases.append(Case(memories, data["line"], data["expect"]))
    return cases


def _hit_rates(cases: list[Case]) -> dict[str, int | float]:
    newest = sum(case.expect in [m.text for m in case.memories[-RECALL:]] for case in cases)
    found = 0
    for case in cases:
        chosen = recall(case.memories, [case.line], limit=RECALL, recent=RECALL_RECENT, subject=SUBJECT)
        found += case.expect in [item.text for item in chosen]
    return {
        "cases": len(cases),
        "newest10_percent": round(100 * newest / len(cases), 1),
        "recall_percent": round(100 * found / len(cases), 1),
    }


def _timing(cases: list[Case], repeats: int) -> dict[str, float]:
    def once(case: Case) -> float:
        began = time.perf_counter()
        recall(case.memories, [case.line, "さっきの話だけど"], limit=RECALL, recent=RECALL_RECENT, subject=SUBJECT)
        return (time.perf_counter() - began) * 1e6

    cached: list[float] = []
    rebuilt: list[float] = []
    gc.collect()
    gc.disable()  # the collector's pauses belong to the whole process, not to recall
    try:
        for _ in range(repeats):
            for case in cases:
                recall_module._index.cache_clear()  # as after an extraction: the memory list is new
                rebuilt.append(once(case))
                cached.append(once(case))
    finally:
        gc.enable()
    return {
        "cached_median_us": round(statistics.median(cached), 1),
        "cached_p99_us": round(sorted(cached)[int(0.99 * (len(cached) - 1))], 1),
        "rebuilt_median_us": round(statistics.median(rebuilt), 1),
        "rebuilt_p99_us": round(sorted(rebuilt)[int(0.99 * (len(rebuilt) - 1))], 1),
    }


def measure(files: int = 200, seed: int = 12, repeats: int = 5) -> dict[str, Any]:
    shared_word = generated(files, seed)
    result: dict[str, Any] = {
        "files": files,
        "seed": seed,
        "shared_word": _hit_rates(shared_word),
        "public_examples": _hit_rates(public_examples()),
        "paraphrase": _hit_rates(generated(files, seed + 1, paraphrase=True)),
        "time": _timing(shared_word[:50], repeats),
    }
    hit = result["shared_word"]["recall_percent"]
    result["goal"] = f"shared word ≥ {GOAL_PERCENT:g} % in the prompt"
    result["pass"] = hit >= GOAL_PERCENT
    return result


def print_result(result: dict[str, Any]) -> None:
    print(f"\nRecall (issue 12): {result['files']} generated memory files of 60, seed {result['seed']}")
    print(f"  {'lines':<18}{'cases':>6}{'newest-10':>11}{'recall':>9}")
    for name in ("shared_word", "public_examples", "paraphrase"):
        row = result[name]
        label = name.replace("_", " ")
        print(f"  {label:<18}{row['cases']:>6}{row['newest10_percent']:>10}%{row['recall_percent']:>8}%")
    timing = result["time"]
    print(
        f"  recall() of 60 memories: index cached {timing['cached_median_us']} µs median "
        f"(p99 {timing['cached_p99_us']}), index rebuilt {timing['rebuilt_median_us']} µs "
        f"(p99 {timing['rebuilt_p99_us']}); the p99 is the machine's: a 2-core box shared with other work"
    )
    print(f"  goal: {result['goal']}: {'PASS' if result['pass'] else 'MISS'}")


async def part(bench: object) -> dict[str, Any]:
    """The hook for tests/perf/bench.py (no world, no daemon: recall is pure code)."""
    return measure()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.recall_quality", description=__doc__)
    parser.add_argument("--files", type=int, default=200, help="generated memory files (default 200)")
    parser.add_argument("--seed", type=int, default=12)
    args = parser.parse_args(argv)
    print_result(measure(args.files, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
