from daemon.engine.stops import StopMatcher


def feed(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.push(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_inside_one_piece_is_cut():
    m = StopMatcher(["END"])
    assert m.push("abcENDxyz") == "abc"
    assert m.stopped


def test_the_stop_string_that_matched_is_named():
    m = StopMatcher(["xyz", "END", "b"])
    assert m.push("aaEN") == "aa" and m.matched is None
    assert m.push("Dxb") == "" and m.matched == "END"  # the earliest, not the first listed


def test_stop_string_spanning_pieces_is_never_emitted():
    m = StopMatcher(["STOP"])
    emitted = [m.push(p) for p in ["ab", "cS", "T", "O", "Pzz"]]
    assert emitted == ["ab", "c", "", "", ""]
    assert m.stopped and m.flush() == ""


def test_false_prefix_is_released_when_it_cannot_match():
    m = StopMatcher(["STOP"])
    assert m.push("xST") == "x"
    assert m.push("A") == "STA"
    assert not m.stopped


def test_held_text_is_flushed_at_the_end():
    m = StopMatcher(["STOP"])
    assert feed(m, ["hi S", "TO"]) == "hi STO"


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(["world", "lo"])
    assert m.push("hello world") == "hel"


def test_no_stop_before_min_tokens():
    m = StopMatcher(["x"])
    assert m.push("axb", can_stop=False) == "axb"
    assert m.push("cxd") == "c" and m.stopped


def test_no_stop_strings_passes_everything():
    m = StopMatcher(["", ""])
    assert m.push("anything") == "anything"
