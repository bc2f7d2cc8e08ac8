"""`aiorl.p2p.window`: the windows a Sender waits for, as pure bookkeeping."""

from __future__ import annotations

import asyncio

import pytest

from aiorl.p2p.window import DEFAULT_RECEIVE_WINDOW, ReceiveWindow, Window, receive_window

pytestmark = pytest.mark.timeout(30)


def test_a_message_goes_while_the_window_is_not_spent_whatever_its_size() -> None:
    w = ReceiveWindow(100)
    assert w.has_room()
    w.charge(500)  # larger than the window: it went because nothing was charged
    assert not w.has_room() and w.outstanding == 500
    w.taken(1)
    assert w.has_room() and w.outstanding == 0
    w.charge(60)
    assert w.has_room() and not w.has_room(queued=40)  # a batch about to leave counts


def test_taken_releases_the_oldest_costs_and_never_more_than_was_charged() -> None:
    w = ReceiveWindow(1000)
    for cost in (10, 20, 30):
        w.charge(cost)
    w.taken(2)
    assert w.outstanding == 30
    w.taken(5)  # a stale or excessive grant: nothing below zero
    assert w.outstanding == 0
    w.charge(7)
    assert w.outstanding == 7


def test_a_waiter_wakes_at_a_release_or_a_wake() -> None:
    loop = asyncio.new_event_loop()
    try:
        w = Window(10)
        first = w.wait_room(loop)
        assert w.wait_room(loop) is first  # one waiter for the pump
        w.release(5)
        assert first.done()
        second = w.wait_room(loop)
        assert second is not first and not second.done()
        w.wake()  # the pair is lost: the pump ends
        assert second.done()
    finally:
        loop.close()


def test_the_setting_is_a_positive_byte_count() -> None:
    assert receive_window({}) == DEFAULT_RECEIVE_WINDOW == 1 << 30
    assert receive_window({"AIORL_P2P_WINDOW": "65536"}) == 65536
    for junk in ("0", "-1", "lots", "1.5"):
        with pytest.raises(ValueError, match="AIORL_P2P_WINDOW"):
            receive_window({"AIORL_P2P_WINDOW": junk})


def test_thousands_of_small_messages_keep_their_count_across_grants() -> None:
    w = ReceiveWindow(1 << 30)
    w.charge_batch(5000, 5000)
    w.charge(100)
    w.taken(3000)  # past the point where the taken entries are dropped
    assert w.outstanding == 2100
    w.charge_batch(2, 20)
    w.taken(2001)
    assert w.outstanding == 20
    w.taken(1)
    assert w.outstanding == 10
    w.taken(10)
    assert w.outstanding == 0


def test_part_of_a_batch_releases_its_share_and_the_rest_of_it_the_remainder() -> None:
    w = ReceiveWindow(1 << 30)
    w.charge_batch(4, 4000)
    w.charge(500)
    w.taken(1)
    assert w.outstanding == 3500  # a quarter of the batch
    w.taken(3)
    assert w.outstanding == 500
    for _ in range(3000):  # many charges, taken in uneven grants: the total stays exact
        w.charge_batch(3, 30)
    w.taken(4000)  # the single message, then 1,333 whole batches
    assert w.outstanding == 90_500 - 500 - 1333 * 30
    w.taken(2)  # two thirds of the next batch
    assert w.outstanding == 90_500 - 500 - 1333 * 30 - 20
    w.taken(10**9)
    assert w.outstanding == 0
