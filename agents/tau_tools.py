"""The customer-service tools of the tool workload, written for this project against the tau2-bench retail
database and the tau-bench airline database (the data tau2's tasks were made on; no tool code was published with
it). Each tool is a plain function of the episode's database (a dict, changed in place) and its JSON
arguments; a refused request raises `ToolError`, whose message the model reads as the result. The names and
arguments are those the tasks' gold actions use, so replaying a task's actions on a fresh database gives the
state a correct agent reaches (`tau.TauHarness.score`).
"""

from __future__ import annotations

import copy
import inspect
import re
import typing


class ToolError(ValueError):
    pass


def _need(cond, message: str):
    if not cond:
        raise ToolError(message)


def calculate(db, expression: str):
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses)."""
    _need(re.fullmatch(r"[0-9+\-*/(). ]+", expression or ""), "the expression may hold only numbers, + - * / ( ) .")
    try:
        return str(round(float(eval(expression, {"__builtins__": {}}, {})), 2))  # the pattern leaves no names
    except (SyntaxError, ZeroDivisionError) as e:
        raise ToolError(f"cannot evaluate {expression!r}: {e}") from None


def transfer_to_human_agents(db, summary: str):
    """Transfer the user to a human agent, with a summary of the issue."""
    return "Transfer successful"


# ---- retail (tau2 retail db.json: products, users, orders) -------------------------------------------------
def find_user_id_by_email(db, email: str):
    """Find a user id by email."""
    for uid, u in db["users"].items():
        if u["email"].lower() == str(email).lower():
            return uid
    raise ToolError("user not found")


def find_user_id_by_name_zip(db, first_name: str, last_name: str, zip: str):
    """Find a user id by first name, last name and zip code."""
    for uid, u in db["users"].items():
        n = u["name"]
        if (n["first_name"].lower(), n["last_name"].lower(), u["address"]["zip"]) == (
            str(first_name).lower(),
            str(last_name).lower(),
            str(zip),
        ):
            return uid
    raise ToolError("user not found")


def get_user_details(db, user_id: str):
    """The details of a user (retail: orders and payment methods; airline: reservations and membership)."""
    _need(user_id in db["users"], "user not found")
    return db["users"][user_id]


def get_order_details(db, order_id: str):
    """The status and details of an order."""
    _need(order_id in db["orders"], "order not found")
    return db["orders"][order_id]


def get_product_details(db, product_id: str):
    """The inventory details of a product, with its variants."""
    _need(product_id in db["products"], "product not found")
    return db["products"][product_id]


def get_item_details(db, item_id: str):
    """The details of one item (a product variant)."""
    for p in db["products"].values():
        if item_id in p["variants"]:
            return {**p["variants"][item_id], "product_id": p["product_id"], "name": p["name"]}
    raise ToolError("item not found")


def list_all_product_types(db):
    """The names and ids of all product types."""
    return dict(sorted((p["name"], pid) for pid, p in db["products"].items()))


def _order(db, order_id: str, *statuses: str) -> dict:
    _need(order_id in db["orders"], "order not found")
    o = db["orders"][order_id]
    _need(o["status"] in statuses, f"the order is {o['status']}, not {' or '.join(statuses)}")
    return o


def _payment_method(db, user_id: str, pm_id: str) -> dict:
    pms = db["users"][user_id]["payment_methods"]
    _need(pm_id in pms, "payment method not found")
    return pms[pm_id]


def _variant(db, item_id: str) -> tuple[str, dict]:
    for pid, p in db["products"].items():
        if item_id in p["variants"]:
            return pid, p["variants"][item_id]
    raise ToolError(f"item {item_id} not found")


def _swap_price(db, order: dict, item_ids: list, new_item_ids: list) -> tuple[float, list[tuple[dict, dict]]]:
    _need(len(item_ids) == len(new_item_ids), "item_ids and new_item_ids must have the same length")
    items = list(order["items"])
    pairs, diff = [], 0.0
    for old_id, new_id in zip(item_ids, new_item_ids):
        match = next((it for it in items if it["item_id"] == old_id), None)
        _need(match is not None, f"item {old_id} not found in the order")
        items.remove(match)
        pid, variant = _variant(db, new_id)
        _need(pid == match["product_id"], f"new item {new_id} is not the same product as {old_id}")
        _need(variant["available"], f"new item {new_id} is not available")
        diff += variant["price"] - match["price"]
        pairs.append((match, variant))
    return round(diff, 2), pairs


def _charge(db, user_id: str, pm_id: str, amount: float) -> None:
    pm = _payment_method(db, user_id, pm_id)
    if pm["source"] == "gift_card":
        _need(pm["balance"] >= amount, "insufficient gift card balance")
        pm["balance"] = round(pm["balance"] - amount, 2)


def cancel_pending_order(db, order_id: str, reason: str):
    """Cancel a pending order; reason is 'no longer needed' or 'ordered by mistake'."""
    o = _order(db, order_id, "pending")
    _need(reason in ("no longer needed", "ordered by mistake"), "invalid reason")
    refunds = []
    for p in o["payment_history"]:
        refunds.append(
            {"transaction_type": "refund", "amount": p["amount"], "payment_method_id": p["payment_method_id"]}
        )
        pm = db["users"][o["user_id"]]["payment_methods"].get(p["payment_method_id"], {})
        if pm.get("source") == "gift_card":
            pm["balance"] = round(pm["balance"] + p["amount"], 2)
    o["status"], o["cancel_reason"] = "cancelled", reason
    o["payment_history"].extend(refunds)
    return o


def modify_pending_order_address(
    db, order_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
):
    """Change the shipping address of a pending order."""
    o = _order(db, order_id, "pending")
    o["address"] = {
        "address1": address1,
        "address2": address2,
        "city": city,
        "country": country,
        "state": state,
        "zip": zip,
    }
    return o


def modify_pending_order_items(db, order_id: str, item_ids: list, new_item_ids: list, payment_method_id: str):
    """Swap items of a pending order for other variants of the same products (once per order)."""
    o = _order(db, order_id, "pending")
    diff, pairs = _swap_price(db, o, item_ids, new_item_ids)
    _charge(db, o["user_id"], payment_method_id, diff)
    if diff != 0:
        kind = "payment" if diff > 0 else "refund"
        o["payment_history"].append(
            {"transaction_type": kind, "amount": abs(diff), "payment_method_id": payment_method_id}
        )
    for item, variant in pairs:
        item.update(item_id=variant["item_id"], price=variant["price"], options=variant["options"])
    o["status"] = "pending (item modified)"
    return o


def modify_pending_order_payment(db, order_id: str, payment_method_id: str):
    """Pay a pending order with another payment method of the user."""
    o = _order(db, order_id, "pending")
    _need(len(o["payment_history"]) == 1, "the order has more than one payment")
    old = o["payment_history"][0]
    _need(old["payment_method_id"] != payment_method_id, "that is already the order's payment method")
    amount = old["amount"]
    _charge(db, o["user_id"], payment_method_id, amount)
    old_pm = db["users"][o["user_id"]]["payment_methods"].get(old["payment_method_id"], {})
    if old_pm.get("source") == "gift_card":
        old_pm["balance"] = round(old_pm["balance"] + amount, 2)
    o["payment_history"] += [
        {"transaction_type": "payment", "amount": amount, "payment_method_id": payment_method_id},
        {"transaction_type": "refund", "amount": amount, "payment_method_id": old["payment_method_id"]},
    ]
    return o


def modify_user_address(db, user_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str):
    """Change a user's default address."""
    _need(user_id in db["users"], "user not found")
    db["users"][user_id]["address"] = {
        "address1": address1,
        "address2": address2,
        "city": city,
        "country": country,
        "state": state,
        "zip": zip,
    }
    return db["users"][user_id]


def return_delivered_order_items(db, order_id: str, item_ids: list, payment_method_id: str):
    """Request the return of delivered items, refunded to the original payment method or a gift card."""
    o = _order(db, order_id, "delivered")
    pm = _payment_method(db, o["user_id"], payment_method_id)
    original = o["payment_history"][0]["payment_method_id"]
    _need(
        pm["source"] == "gift_card" or payment_method_id == original,
        "refunds go to the original payment method or a gift card",
    )
    ids = [it["item_id"] for it in o["items"]]
    for i in item_ids:
        _need(i in ids, f"item {i} not found in the order")
        ids.remove(i)
    o["status"], o["return_items"], o["return_payment_method_id"] = (
        "return requested",
        sorted(item_ids),
        payment_method_id,
    )
    return o


def exchange_delivered_order_items(db, order_id: str, item_ids: list, new_item_ids: list, payment_method_id: str):
    """Request an exchange of delivered items for other variants of the same products."""
    o = _order(db, order_id, "delivered")
    diff, _ = _swap_price(db, o, item_ids, new_item_ids)
    pm = _payment_method(db, o["user_id"], payment_method_id)
    if pm["source"] == "gift_card":
        _need(pm["balance"] >= diff, "insufficient gift card balance")
    o.update(
        status="exchange requested",
        exchange_items=sorted(item_ids),
        exchange_new_items=sorted(new_item_ids),
        exchange_payment_method_id=payment_method_id,
        exchange_price_difference=diff,
    )
    return o


# ---- airline (tau-bench airline: flights, reservations, users) ---------------------------------------------
def get_reservation_details(db, reservation_id: str):
    """The details of a reservation."""
    _need(reservation_id in db["reservations"], "reservation not found")
    return db["reservations"][reservation_id]


def list_all_airports(db):
    """The IATA codes of all airports served."""
    return sorted({f["origin"] for f in db["flights"].values()} | {f["destination"] for f in db["flights"].values()})


def _on(flight: dict, date: str) -> dict | None:
    d = flight["dates"].get(date)
    if d is None or d.get("status") != "available":
        return None
    keep = ("flight_number", "origin", "destination", "scheduled_departure_time_est", "scheduled_arrival_time_est")
    return {
        **{k: flight[k] for k in keep},
        "date": date,
        "available_seats": d["available_seats"],
        "prices": d["prices"],
    }


def search_direct_flight(db, origin: str, destination: str, date: str):
    """Direct flights between two airports on a date (YYYY-MM-DD) with seats and prices."""
    return [
        x
        for f in db["flights"].values()
        if f["origin"] == origin and f["destination"] == destination and (x := _on(f, date))
    ]


def search_onestop_flight(db, origin: str, destination: str, date: str):
    """One-stop connections between two airports on a date (YYYY-MM-DD)."""
    out = []
    for f1 in db["flights"].values():
        a = _on(f1, date) if f1["origin"] == origin else None
        if not a:
            continue
        for f2 in db["flights"].values():
            b = _on(f2, date) if f2["origin"] == f1["destination"] and f2["destination"] == destination else None
            if b and b["scheduled_departure_time_est"] > a["scheduled_arrival_time_est"]:
                out.append([a, b])
    return out


def _flight_prices(db, flights: list, cabin: str) -> list[dict]:
    out = []
    for leg in flights:
        f = db["flights"].get(leg["flight_number"])
        _need(f is not None, f"flight {leg['flight_number']} not found")
        d = _on(f, leg["date"])
        _need(d is not None, f"flight {leg['flight_number']} is not available on {leg['date']}")
        _need(cabin in d["prices"], f"unknown cabin {cabin!r}")
        out.append(
            {
                "flight_number": f["flight_number"],
                "origin": f["origin"],
                "destination": f["destination"],
                "date": leg["date"],
                "price": d["prices"][cabin],
            }
        )
    return out


def _pay(db, user: dict, payment_id: str, amount: float) -> None:
    _need(payment_id in user["payment_methods"], "payment method not found")
    pm = user["payment_methods"][payment_id]
    if pm["source"] in ("gift_card", "certificate"):
        _need(pm["amount"] >= amount, f"not enough balance on {payment_id}")
        if pm["source"] == "certificate":
            del user["payment_methods"][payment_id]
        else:
            pm["amount"] = round(pm["amount"] - amount, 2)


def book_reservation(
    db,
    user_id: str,
    origin: str,
    destination: str,
    flight_type: str,
    cabin: str,
    flights: list,
    passengers: list,
    payment_methods: list,
    total_baggages: int,
    nonfree_baggages: int,
    insurance: str,
):
    """Book a reservation; payments must add up to the total price."""
    _need(user_id in db["users"], "user not found")
    user = db["users"][user_id]
    legs = _flight_prices(db, flights, cabin)
    total = (
        len(passengers) * (sum(x["price"] for x in legs) + (30 if insurance == "yes" else 0)) + 50 * nonfree_baggages
    )
    _need(
        round(sum(p["amount"] for p in payment_methods), 2) == round(total, 2),
        f"the payments add up to {sum(p['amount'] for p in payment_methods)}, the price is {total}",
    )
    for p in payment_methods:
        _pay(db, user, p["payment_id"], p["amount"])
    rid = "HATHAT"
    while rid in db["reservations"]:
        rid = rid[:-1] + chr(ord(rid[-1]) + 1)
    res = {
        "reservation_id": rid,
        "user_id": user_id,
        "origin": origin,
        "destination": destination,
        "flight_type": flight_type,
        "cabin": cabin,
        "flights": legs,
        "passengers": passengers,
        "payment_history": payment_methods,
        "created_at": "2024-05-15T15:00:00",
        "total_baggages": total_baggages,
        "nonfree_baggages": nonfree_baggages,
        "insurance": insurance,
    }
    db["reservations"][rid] = res
    user["reservations"].append(rid)
    return res


def cancel_reservation(db, reservation_id: str):
    """Cancel a reservation; every payment is refunded."""
    r = get_reservation_details(db, reservation_id)
    _need(r.get("status") != "cancelled", "the reservation is already cancelled")
    r["payment_history"] += [{"payment_id": p["payment_id"], "amount": -p["amount"]} for p in r["payment_history"]]
    r["status"] = "cancelled"
    return r


def update_reservation_baggages(db, reservation_id: str, total_baggages: int, nonfree_baggages: int, payment_id: str):
    """Change the baggage of a reservation; added non-free bags cost 50 each."""
    r = get_reservation_details(db, reservation_id)
    _need(total_baggages >= r["total_baggages"], "bags can be added, not removed")
    cost = 50 * max(0, nonfree_baggages - r["nonfree_baggages"])
    _pay(db, db["users"][r["user_id"]], payment_id, cost)
    if cost:
        r["payment_history"].append({"payment_id": payment_id, "amount": cost})
    r["total_baggages"], r["nonfree_baggages"] = total_baggages, nonfree_baggages
    return r


def update_reservation_flights(db, reservation_id: str, cabin: str, flights: list, payment_id: str):
    """Change the flights or cabin of a reservation; the price difference is paid or refunded."""
    r = get_reservation_details(db, reservation_id)
    kept = {(x["flight_number"], x["date"]): x for x in r["flights"]} if cabin == r["cabin"] else {}
    legs = [kept.get((f["flight_number"], f["date"])) or _flight_prices(db, [f], cabin)[0] for f in flights]
    diff = len(r["passengers"]) * (sum(x["price"] for x in legs) - sum(x["price"] for x in r["flights"]))
    if diff > 0:
        _pay(db, db["users"][r["user_id"]], payment_id, diff)
    if diff:
        r["payment_history"].append({"payment_id": payment_id, "amount": diff})
    r["flights"], r["cabin"] = legs, cabin
    return r


def update_reservation_passengers(db, reservation_id: str, passengers: list):
    """Change the passengers' details (their number stays)."""
    r = get_reservation_details(db, reservation_id)
    _need(len(passengers) == len(r["passengers"]), "the number of passengers cannot change")
    r["passengers"] = passengers
    return r


def send_certificate(db, user_id: str, amount: float):
    """Send the user a travel certificate of the given amount (compensation)."""
    _need(user_id in db["users"], "user not found")
    pms = db["users"][user_id]["payment_methods"]
    n = 1
    while f"certificate_{n}" in pms:
        n += 1
    pms[f"certificate_{n}"] = {"source": "certificate", "amount": amount, "id": f"certificate_{n}"}
    return f"Certificate certificate_{n} added to user {user_id} with amount {amount}."


RETAIL = [
    calculate,
    transfer_to_human_agents,
    find_user_id_by_email,
    find_user_id_by_name_zip,
    get_user_details,
    get_order_details,
    get_product_details,
    get_item_details,
    list_all_product_types,
    cancel_pending_order,
    modify_pending_order_address,
    modify_pending_order_items,
    modify_pending_order_payment,
    modify_user_address,
    return_delivered_order_items,
    exchange_delivered_order_items,
]
AIRLINE = [
    calculate,
    transfer_to_human_agents,
    get_user_details,
    get_reservation_details,
    list_all_airports,
    search_direct_flight,
    search_onestop_flight,
    book_reservation,
    cancel_reservation,
    update_reservation_baggages,
    update_reservation_flights,
    update_reservation_passengers,
    send_certificate,
]
DOMAINS = {"retail": {f.__name__: f for f in RETAIL}, "airline": {f.__name__: f for f in AIRLINE}}

_JSON_TYPES = {str: "string", int: "integer", float: "number", list: "array", dict: "object"}


def schema(fn, skip: int = 1) -> dict:
    """The OpenAI `tools` entry of a tool, from its signature and docstring; the first `skip` parameters (the
    database) are not the model's to give."""
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for name in list(inspect.signature(fn).parameters)[skip:]:
        ann = hints.get(name, str)
        props[name] = {"type": _JSON_TYPES.get(ann, "string")}
        if ann is list:
            props[name]["items"] = {
                "type": "object" if name in ("flights", "passengers", "payment_methods") else "string"
            }
        required.append(name)
    doc = (fn.__doc__ or fn.__name__).strip()
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def call(domain: str, db: dict, name: str, args: dict):
    """Run one tool -> its result; unknown tools and wrong arguments are ToolErrors."""
    fn = DOMAINS[domain].get(name)
    _need(fn is not None, f"unknown tool {name!r}")
    _need(isinstance(args, dict), "the arguments must be a JSON object")
    try:
        inspect.signature(fn).bind(db, **args)
    except TypeError as e:
        raise ToolError(f"wrong arguments for {name}: {e}") from None
    return fn(db, **args)


def replay(domain: str, db: dict, actions: list[dict]) -> dict:
    """A copy of db after the gold actions (errors ignored, as a gold action that fails changes nothing)."""
    db = copy.deepcopy(db)
    for a in actions:
        try:
            call(domain, db, a["name"], a.get("arguments") or {})
        except ToolError:
            pass
    return db
