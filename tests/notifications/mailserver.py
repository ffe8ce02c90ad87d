"""A small real SMTP server on 127.0.0.1 for the e-mail channel's tests: Django's SMTP backend talks to it over a
socket, and each test scripts what it answers to RCPT TO and to the message (DATA), as a real server may."""
import socketserver
import threading


class MailServer:
    """Records each accepted message (its recipients and bytes). `rcpt_answers` and `data_answers` are the next
    answers to RCPT TO and to the end of a message (then "250 OK")."""

    def __init__(self):
        self.messages: list[tuple[list[str], bytes]] = []
        self.rcpt_answers: list[str] = []
        self.data_answers: list[str] = []
        server = self

        class Session(socketserver.StreamRequestHandler):
            def reply(self, line: str) -> None:
                self.wfile.write(line.encode() + b"\r\n")

            def handle(self):
                recipients: list[str] = []
                self.reply("220 mail.test ESMTP")
                while line := self.rfile.readline():
                    verb = line.split(b" ", 1)[0].split(b":", 1)[0].strip().upper()
                    if verb in (b"EHLO", b"HELO"):
                        self.reply("250 mail.test")
                    elif verb == b"MAIL":
                        recipients = []
                        self.reply("250 OK")
                    elif verb == b"RCPT":
                        answer = server.rcpt_answers.pop(0) if server.rcpt_answers else "250 OK"
                        if answer.startswith("250"):
                            recipients.append(line.split(b":", 1)[1].strip().strip(b"<>").decode())
                        self.reply(answer)
                    elif verb == b"DATA":
                        self.reply("354 go ahead")
                        data = b""
                        while (chunk := self.rfile.readline()) not in (b".\r\n", b""):
                            data += chunk
                        answer = server.data_answers.pop(0) if server.data_answers else "250 OK"
                        if answer.startswith("250"):
                            server.messages.append((recipients, data))
                        self.reply(answer)
                    elif verb in (b"RSET", b"NOOP"):
                        self.reply("250 OK")
                    elif verb == b"QUIT":
                        self.reply("221 bye")
                        return
                    else:
                        self.reply("502 not implemented")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Session)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        # stop() waits for serve_forever to see the shutdown: every poll_interval (0.5 s by default)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
