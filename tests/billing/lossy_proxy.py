"""An HTTP proxy in front of localstripe that can lose answers: the request reaches localstripe (which acts on
it), and the connection is dropped before the answer comes back, as a timeout looks to the platform; or lose the
request itself (`drop`), which never reaches localstripe and looks the same to the platform; or refuse it
(`refuse`): never sent on, answered with Stripe's 403 for a key that may not do it (a definite error, not an
outage)."""
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class LossyProxy:
    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.lose: set[tuple[str, str]] = set()  # (method, path without the query) whose answers are lost
        self.lost: list[str] = []
        self.drop: set[tuple[str, str]] = set()  # (method, path) never sent on: the connection drops first
        self.refuse: set[tuple[str, str]] = set()  # (method, path) never sent on: answered 403
        self.refused: list[str] = []  # "METHOD path?query" of each request refused
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if (self.command, self.path.partition("?")[0]) in proxy.drop:
                    proxy.lost.append(f"{self.command} {self.path} (never sent)")
                    self.close_connection = True
                    return
                if (self.command, self.path.partition("?")[0]) in proxy.refuse:
                    proxy.refused.append(f"{self.command} {self.path}")
                    data = json.dumps({"error": {"type": "invalid_request_error", "code": "secret_key_required",
                                                 "message": "The provided key does not have the required "
                                                            "permissions for this endpoint."}}).encode()
                    self.send_response(403)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                upstream_conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream_conn.request(self.command, self.path, body=body, headers=headers)
                answer = upstream_conn.getresponse()
                data = answer.read()
                upstream_conn.close()
                if (self.command, self.path.partition("?")[0]) in proxy.lose:
                    proxy.lost.append(f"{self.command} {self.path}")
                    self.close_connection = True  # acted on upstream; no answer here
                    return
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _relay  # noqa: N815 (http.server's names)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # close() waits for serve_forever to see the shutdown: every poll_interval (0.5 s by default)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
