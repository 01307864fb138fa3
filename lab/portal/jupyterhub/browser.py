"""A portal user's browser: logs in to JupyterHub with a password and does
one thing, printing one line per result for the test to check.

  browser.py HUB USER PASSWORD spawn [SERVER [OPTIONS_JSON]]   READY <url> | FAILED <message>
  browser.py HUB USER PASSWORD get PATH                        <status> <server header> [hubServerUser/Name] <body, 300 chars>
  browser.py HUB USER PASSWORD share SERVER WITH               SHARED <with> | <status> <body>
  browser.py HUB USER PASSWORD stop [SERVER]                   STOPPED | <status> <body>

Everything goes through the hub's public URL (the proxy), as a browser's
requests would; the API calls use the session's cookie and XSRF token.
"""
import json
import re
import sys

import requests

hub, user, password, what = sys.argv[1:5]
args = sys.argv[5:]
s = requests.Session()


def xsrf():
    return {"X-XSRFToken": s.cookies.get("_xsrf", path="/hub/") or ""}


def login():
    r = s.get(f"{hub}/hub/login", timeout=30)
    r = s.post(
        f"{hub}/hub/login",
        data={"username": user, "password": password, "_xsrf": s.cookies.get("_xsrf", path="/hub/")},
        timeout=30,
        allow_redirects=False,
    )
    if r.status_code != 302:
        print(f"LOGIN-FAILED {r.status_code}")
        sys.exit(0)


def api(method, path, **kw):
    return s.request(method, f"{hub}/hub/api{path}", headers=xsrf(), timeout=90, **kw)


login()
if what == "spawn":
    name = args[0] if args else ""
    options = json.loads(args[1]) if len(args) > 1 else {}
    r = api("POST", f"/users/{user}/servers/{name}", json=options)
    if r.status_code not in (201, 202):
        print(f"FAILED {r.status_code} {r.text[:200]}")
        sys.exit(0)
    # The progress stream ends with the server ready or its spawn failed:
    # the hub's own acknowledgement, nothing to poll.
    with api("GET", f"/users/{user}/servers/{name}/progress", stream=True) as r:
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if ev.get("ready"):
                print("READY", ev.get("url", ""))
                break
            if ev.get("failed"):
                print("FAILED", ev.get("message", "").replace("\n", " ")[:300])
                break
        else:
            print("FAILED progress stream ended")
elif what == "get":
    r = s.get(f"{hub}{args[0]}", timeout=60)
    if "<h1 class=\"text-center\">Authorize access</h1>" in r.text:
        # Another user's (shared) server: JupyterHub asks once, as a person
        # would be asked, to let it identify us; click "Authorize".
        fields = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', r.text)
        r = s.post(r.url, data=fields, timeout=60)
    # Whose JupyterLab page this is (its page config names the server).
    owner = " ".join(re.findall(r'"hubServer(?:User|Name)": "[^"]*"', r.text))
    body = r.text.replace("\n", " ")[:300]
    print(r.status_code, r.headers.get("Server", "-").replace(" ", "_"), owner, body)
elif what == "share":
    server, other = args
    r = api("POST", f"/shares/{user}/{server}", json={"user": other})
    print(f"SHARED {other}" if r.status_code in (200, 201) else f"{r.status_code} {r.text[:200]}")
elif what == "stop":
    name = args[0] if args else ""
    r = api("DELETE", f"/users/{user}/servers/{name}")
    print("STOPPED" if r.status_code in (202, 204) else f"{r.status_code} {r.text[:200]}")
