# JupyterHub on the testbed's portal node (lab/portal/jupyterhub): the hub and
# its configurable-http-proxy run as a service account that is NOT an exempt
# connector; single-user servers are Slurm jobs that batchspawner submits as
# each user through sudo. Written as a site would (docs/portals.md); the
# test's paths come from PAL_HUB_* in the hub's environment.
import asyncio
import grp
import json
import os
import re
import shlex
from urllib.parse import urlparse

from batchspawner import SlurmSpawner
from jupyterhub import apihandlers
from jupyterhub.apihandlers import APIHandler
from jupyterhub.auth import Authenticator
from jupyterhub.proxy import ConfigurableHTTPProxy
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from traitlets import Dict, Unicode

HUB_DIR = os.environ["PAL_HUB_DIR"]
PORTAL = os.environ["PAL_HUB_PORTAL"]  # the portal node's address
VENV = os.environ.get("PAL_HUB_VENV", "/opt/pal-hub")
PALISADE = os.environ.get("PAL_HUB_PALISADE", "palisade")
HUB_ACCOUNT = os.environ.get("USER", "jupyterhub")
# The delegation's forwarder (`palisade portal forward --user-in-path`), read
# at every spawn: "" routes to the job's node and port directly (what an
# exempt proxy would need). The test switches it for its positive control.
FORWARD_FILE = f"{HUB_DIR}/forward"


def forward_url():
    try:
        with open(FORWARD_FILE) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


class FixedPasswordAuthenticator(Authenticator):
    """Each user logs in with their own password (a file only the hub reads)."""

    passwords = Dict(Unicode()).tag(config=True)

    async def authenticate(self, handler, data):
        want = self.passwords.get(data.get("username", ""))
        if want and data.get("password") == want:
            return data["username"]
        return None


class PortOnlyBatchSpawnerAPIHandler(APIHandler):
    """batchspawner 1.3.0's /hub/api/batchspawner sets ANY attribute of the
    caller's spawner from the JSON it is sent (exec_prefix,
    batch_cancel_cmd, ...): with the token every single-user job holds, a
    user runs shell commands as the hub's account, and through its sudo
    rule as any other user (verified on the testbed). A site must replace
    it: here it takes the port, and nothing else, from the server's token."""

    @web.authenticated
    def post(self):
        token = self.get_auth_token()
        spawner = next((s for s in self.current_user.spawners.values() if s.api_token == token), None)
        data = self.get_json_body() or {}
        port = data.get("port")
        if spawner is None or set(data) != {"port"} or type(port) is not int or not 0 < port < 65536:
            raise web.HTTPError(400, "batchspawner: only {\"port\": N}, with the server's own token")
        spawner.port = port
        self.set_status(201)
        self.finish(json.dumps({"message": "BatchSpawner data configured"}))


apihandlers.default_handlers[:] = [
    (p, PortOnlyBatchSpawnerAPIHandler if p == r"/api/batchspawner" else h, *rest)
    for p, h, *rest in apihandlers.default_handlers
]


class PortalSpawner(SlurmSpawner):
    """SlurmSpawner, plus the site's choices.

    user_options {"node": N} places the server on node N. A named server
    whose name is a project group of the user runs under that group
    (`srun sg GROUP -c ...`, docs/users.md): members reach its listener.

    With a forwarder configured the hub and its proxy reach the server only
    through the delegation: the user's session with the hub's account is
    registered as the user (sudo, the rule batchspawner already needs), the
    proxy's route goes to the forwarder with /as/<user>/rnode/<node>/<port>,
    and the server counts as up only once a request made as the user
    reached it.
    """

    pal_target = Unicode("")

    def _project(self):
        if not self.name:
            return ""
        try:
            g = grp.getgrnam(self.name)
        except KeyError:
            return ""
        return self.name if self.user.name in g.gr_mem else ""

    def get_req_subvars(self):
        subvars = super().get_req_subvars()
        node = self.user_options.get("node", "")
        if node:
            subvars["options"] += " --nodelist=" + shlex.quote(node)
        return subvars

    def cmd_formatted_for_batch(self):
        cmd = super().cmd_formatted_for_batch()
        project = self._project()
        if project:
            return f"/usr/bin/sg {project} -c {shlex.quote(cmd)}"
        return cmd

    def _as_user(self, *argv):
        return " ".join([self.exec_prefix.format(username=self.user.name)] + [shlex.quote(a) for a in argv])

    async def start(self):
        fwd = forward_url()
        ip, port = await super().start()
        self.pal_target = ""
        self.log.info("server of %s (%s) at %s:%s", self.user.name, self.name or "default", ip, port)
        if not fwd:
            return ip, port
        session = [PALISADE, "portal", "session", "--proxy", HUB_ACCOUNT, "--ttl", "2h"]
        if self._project():
            session += ["--group", self._project()]
        await self.run_command(self._as_user(*session))
        self.pal_target = f"{fwd}/as/{self.user.name}/rnode/{ip}/{port}"
        await self._wait_delegated(f"{self.pal_target}{self.server.base_url}api")
        u = urlparse(fwd)
        return u.hostname, u.port

    async def _wait_delegated(self, url):
        """Until a request made as the user through the forwarder reaches
        the server (not yet listening and refused look alike: both end in a
        reset; the job's own timeout ends the wait)."""
        client = AsyncHTTPClient()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.http_timeout
        while True:
            try:
                r = await client.fetch(url, request_timeout=5)
                if r.headers.get("X-JupyterHub-Version"):
                    return
            except HTTPClientError as e:
                if e.response is not None and e.response.headers.get("X-JupyterHub-Version"):
                    return
            except OSError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"{url}: the server did not answer through the delegation in {self.http_timeout} s")
            await asyncio.sleep(0.3)

    async def stop(self, now=False):
        await super().stop(now=now)
        self.pal_target = ""
        others = [s for s in self.user.spawners.values() if s is not self and s.pal_target]
        if forward_url() and not others:
            try:
                await self.run_command(self._as_user(PALISADE, "portal", "end", "--proxy", HUB_ACCOUNT))
            except Exception as e:  # the session expires anyway
                self.log.warning("ending the portal session of %s: %s", self.user.name, e)

    def get_state(self):
        state = super().get_state()
        if self.pal_target:
            state["pal_target"] = self.pal_target
        return state

    def load_state(self, state):
        super().load_state(state)
        self.pal_target = state.get("pal_target", "")

    def clear_state(self):
        super().clear_state()
        self.pal_target = ""


class DelegatingProxy(ConfigurableHTTPProxy):
    """Routes a delegated server to its forwarder path (JupyterHub keeps only
    proto://host:port of a server, the forwarder needs the user and target
    in the path) and reports it back as the hub knows it, so that the hub's
    periodic route check finds nothing to change."""

    async def add_route(self, routespec, target, data):
        user = self.app.users.get(data.get("user", "")) if "user" in data else None
        if user is not None:
            sp = user.spawners.get(data.get("server_name", ""))
            if sp is not None and sp.pal_target:
                target = sp.pal_target
        await super().add_route(routespec, target, data)

    async def get_all_routes(self, client=None):
        routes = await super().get_all_routes()
        for r in routes.values():
            m = re.match(r"^(\w+://[^/]+)/as/[^/]+/rnode/[^/]+/\d+$", r["target"])
            if m:
                r["target"] = m[1]
        return routes


c = get_config()  # noqa: F821 (JupyterHub's config loader defines it)

c.JupyterHub.bind_url = f"http://{PORTAL}:8000"
c.JupyterHub.hub_bind_url = f"http://{PORTAL}:8081"
c.JupyterHub.db_url = f"sqlite:///{HUB_DIR}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = f"{HUB_DIR}/cookie_secret"
c.JupyterHub.pid_file = f"{HUB_DIR}/jupyterhub.pid"
c.JupyterHub.allow_named_servers = True
# Jobs outlive a restart of the hub (it finds them again through squeue).
c.JupyterHub.cleanup_servers = False
# Users may share their servers with other users by name: JupyterHub decides
# who may use a shared server, Palisade which listeners the proxy reaches on
# whose behalf.
c.JupyterHub.load_roles = [{"name": "user", "scopes": ["self", "shares!user", "read:users:name"]}]

c.JupyterHub.proxy_class = DelegatingProxy
c.ConfigurableHTTPProxy.command = [f"{VENV}/node/node_modules/.bin/configurable-http-proxy"]
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:8001"
c.ConfigurableHTTPProxy.pid_file = f"{HUB_DIR}/proxy.pid"

c.JupyterHub.authenticator_class = FixedPasswordAuthenticator
with open(f"{HUB_DIR}/passwords.json") as f:
    c.FixedPasswordAuthenticator.passwords = json.load(f)
c.Authenticator.allowed_users = set(c.FixedPasswordAuthenticator.passwords)

c.JupyterHub.spawner_class = PortalSpawner
c.Spawner.cmd = [f"{VENV}/bin/jupyterhub-singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.http_timeout = 45
c.Spawner.start_timeout = 120
c.Spawner.environment = {"JUPYTER_CONFIG_PATH": f"{HUB_DIR}/jupyter"}
c.BatchSpawnerBase.batchspawner_singleuser_cmd = f"{VENV}/bin/batchspawner-singleuser"
c.BatchSpawnerBase.startup_poll_interval = 0.2
c.SlurmSpawner.req_nprocs = "1"
c.SlurmSpawner.req_runtime = "30:00"
# Servers on the compute nodes; their output next to the hub's state (a
# sticky directory), not in the users' homes.
c.SlurmSpawner.req_options = f"--output={HUB_DIR}/jobs/%u-%j.log" + "".join(
    f" --exclude={n}" for n in os.environ.get("PAL_HUB_EXCLUDE", "").split()
)
