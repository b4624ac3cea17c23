"""The office workload's tools and OfficeBench's evaluation rules, written for this project with python-docx and
openpyxl. Every function runs inside the episode's jail with the episode directory (the task's testbed: data/,
calendar/, emails/) as the working directory; paths are relative to it. Calendars are iCalendar files
(calendar/<user>.ics, one VEVENT per event, times as YYYYMMDDTHHMMSS), mail is one .eml per message
(emails/<user>/<name>.eml), as in OfficeBench's testbeds.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from email import message_from_string, policy
from email.message import EmailMessage
from pathlib import Path


def _p(path: str) -> Path:
    return Path(path.removeprefix("./"))


# ---- reading ---------------------------------------------------------------------------------------------------
def file_text(path: str, doc_type: str | None = None) -> str:
    p = _p(path)
    kind = (doc_type or p.suffix.lstrip(".")).lower()
    if kind == "xlsx":
        import openpyxl

        wb = openpyxl.load_workbook(p, data_only=True)
        out = []
        for ws in wb.worksheets:
            out.append(f"# sheet {ws.title}")
            for r, row in enumerate(ws.iter_rows(values_only=True), 1):
                out.append(f"row {r}: " + " | ".join("" if v is None else str(v) for v in row))
        return "\n".join(out)
    if kind == "docx":
        import docx

        return "\n".join(par.text for par in docx.Document(str(p)).paragraphs)
    if kind == "eml":
        msg = message_from_string(p.read_text(), policy=policy.default)
        body = msg.get_body(preferencelist=("plain",))
        text = body.get_content() if body is not None else ""
        return f"From: {msg['From']}\nTo: {msg['To']}\nSubject: {msg['Subject']}\n\n{text}"
    return p.read_text()


def list_files(path: str = "."):
    """List the files under a folder of the workspace (data/, calendar/, emails/)."""
    root = _p(path)
    return sorted(str(f) for f in root.rglob("*") if f.is_file() and not f.name.startswith("."))


def read_file(path: str):
    """Read a .xlsx (rows), .docx (paragraphs), .eml, .ics or text file."""
    return file_text(path)


# ---- writing ---------------------------------------------------------------------------------------------------
def excel_set_cell(path: str, row: int, column: int, value: str, sheet: str = ""):
    """Set one cell (1-based row and column) of an .xlsx file, creating the file if needed."""
    import openpyxl

    p = _p(path)
    wb = openpyxl.load_workbook(p) if p.exists() else openpyxl.Workbook()
    ws = wb[sheet] if sheet else wb.active
    ws.cell(row=int(row), column=int(column), value=value)
    p.parent.mkdir(parents=True, exist_ok=True)
    wb.save(p)
    return f"set {p} row {row} column {column} to {value!r}"


def excel_write_rows(path: str, rows: list):
    """Write a new .xlsx file whose first sheet holds the given rows (a list of lists)."""
    import openpyxl

    wb = openpyxl.Workbook()
    for r in rows:
        wb.active.append(list(r) if isinstance(r, list) else [r])
    _p(path).parent.mkdir(parents=True, exist_ok=True)
    wb.save(_p(path))
    return f"wrote {len(rows)} rows to {path}"


def word_write(path: str, text: str):
    """Write a .docx file with the given text (one paragraph per line), replacing it if it exists."""
    import docx

    d = docx.Document()
    for line in str(text).split("\n"):
        d.add_paragraph(line)
    _p(path).parent.mkdir(parents=True, exist_ok=True)
    d.save(str(_p(path)))
    return f"wrote {path}"


def write_text(path: str, text: str):
    """Write a plain-text file."""
    _p(path).parent.mkdir(parents=True, exist_ok=True)
    _p(path).write_text(str(text))
    return f"wrote {path}"


def delete_file(path: str):
    """Delete a file of the workspace."""
    _p(path).unlink()
    return f"deleted {path}"


def _ics_time(text: str) -> str:
    for fmt in ("%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.strptime(text.strip(), fmt).strftime("%Y%m%dT%H%M%S")
        except ValueError:
            pass
    raise ValueError(f"time {text!r} is not 'YYYY-MM-DD HH:MM'")


def calendar_add_event(username: str, summary: str, start: str, end: str):
    """Add an event to a user's calendar; start and end as 'YYYY-MM-DD HH:MM'."""
    p = Path("calendar") / f"{username}.ics"
    text = p.read_text() if p.exists() else "BEGIN:VCALENDAR\nVERSION:2.0\nPRODID:dspine\nEND:VCALENDAR\n"
    event = (
        f"BEGIN:VEVENT\nDTEND:{_ics_time(end)}\nDTSTART:{_ics_time(start)}\nSUMMARY:{summary}\n"
        f"UID:{uuid.uuid4()}\nEND:VEVENT\n"
    )
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text.replace("END:VCALENDAR", event + "END:VCALENDAR", 1))
    return f"added {summary!r} to {username}'s calendar"


def calendar_delete_event(username: str, summary: str):
    """Delete the events of a user's calendar whose summary matches."""
    p = Path("calendar") / f"{username}.ics"
    text = p.read_text()
    kept = re.sub(
        r"BEGIN:VEVENT\n(?:(?!END:VEVENT).)*?SUMMARY:" + re.escape(summary) + r"\n.*?END:VEVENT\n",
        "",
        text,
        flags=re.DOTALL,
    )
    p.write_text(kept)
    return f"deleted {text.count('BEGIN:VEVENT') - kept.count('BEGIN:VEVENT')} event(s)"


def email_send(sender: str, recipient: str, subject: str, body: str):
    """Send an email: it is stored as emails/<recipient>/<subject>.eml."""
    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = sender, recipient, subject
    msg.set_content(str(body))
    folder = Path("emails") / recipient.split("@")[0]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / (re.sub(r"[^A-Za-z0-9_-]+", "_", subject)[:60] or "message")).with_suffix(".eml").write_text(
        msg.as_string()
    )
    return f"sent to {recipient}"


TOOLS = [
    list_files,
    read_file,
    excel_set_cell,
    excel_write_rows,
    word_write,
    write_text,
    delete_file,
    calendar_add_event,
    calendar_delete_event,
    email_send,
]


# ---- OfficeBench's evaluation rules ------------------------------------------------------------------------
def _has(rule: dict) -> bool:
    return _p(rule["file"]).exists()


def _contain(a: dict, original: str) -> bool:
    text = file_text(a["file"], a.get("doc_type"))
    return all(k in text for k in a["keywords"])


def _not_contain(a: dict, original: str) -> bool:
    text = file_text(a["file"], a.get("doc_type")) if _p(a["file"]).exists() else ""
    return not any(k in text for k in a["keywords"])


def _cells(a: dict, test) -> bool:
    import openpyxl

    ws = openpyxl.load_workbook(_p(a["file"]), data_only=True).active
    return all(
        test(m, "" if (v := ws.cell(int(m["row"]), int(m["col"])).value) is None else str(v)) for m in a["matches"]
    )


def _diff_contain(a: dict, original: str) -> bool:
    before = file_text(str(Path(original) / a["input_file"].split("testbed/", 1)[1]), a.get("doc_type"))
    after = file_text(a["output_file"], a.get("doc_type"))
    added = "\n".join(line for line in after.splitlines() if line not in set(before.splitlines()))
    return all(k in added for k in a["keywords"])


def _no_overlap(a: dict, original: str) -> bool:
    text = (Path("calendar") / f"{a['username']}.ics").read_text()
    spans = sorted((s[:15], e[:15]) for e, s in re.findall(r"DTEND:(\S+)\s+DTSTART:(\S+)", text))
    return all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))


RULES = {
    "evaluate_contain": _contain,
    "evaluate_not_contain": _not_contain,
    "evaluate_file_exist": lambda a, o: _has(a),
    "evaluate_file_not_exist": lambda a, o: not _has(a),
    "evaluate_excel_cell_value": lambda a, o: _cells(a, lambda m, v: v == str(m["value"])),
    "evaluate_excel_cell_comparator": lambda a, o: _cells(a, lambda m, v: eval(m["comparator"])(v)),  # task data
    "evaluate_diff_contain_text": _diff_contain,
    "evaluate_calendar_no_overlap": _no_overlap,
}


def evaluate(rules: list, original: str):
    """Inside the jail: True when every rule holds (a rule whose file is missing or unreadable fails)."""
    for r in rules:
        try:
            if not RULES[r["function"]](r["args"], original):
                return False
        except Exception:
            return False
    return True
