"""A site's own identity and the peers it pins, kept in step with their files while the daemon
runs (a key rotation, a pin added or removed: no restart). Mixed into ``peer.net.site.Site``,
which sets ``config``, ``name``, ``identity``, ``trust`` and the locks and versions read here."""

from __future__ import annotations

import logging
from pathlib import Path

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from peer.net.identity import CERT_FILE, KEY_FILE, load_identity
from peer.net.trust import PinnedPeer

log = logging.getLogger("privfusion.peer")


class SiteIdentity:
    """Identity refresh and pinned peers of a site (see the module docstring)."""

    # ---- identity -----------------------------------------------------------------------------

    def _identity_files(self) -> tuple:
        """(inode, mtime, size) of the key and the certificate file (None where missing)."""
        out = []
        for name in (KEY_FILE, CERT_FILE):
            try:
                st = (Path(self.config.identity) / name).stat()
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def refresh_identity(self) -> str | None:
        """Put this site's key and certificate back in step with its identity files (after
        ``privfusion peer rotate --activate``, no restart needed): the new pair's fingerprint
        when it is now in use, else None. Two stats when nothing changed (the daemon asks at
        every TLS handshake). A pair that does not load — caught mid-rotation, a key others can
        read, a certificate of another site — leaves the current one in use and is logged;
        the next change of the files is tried again. Calls on connections opened before keep
        the certificate of their handshake; receipts are signed with the key in use, so during
        the rotation's overlap (peers pin both) either verifies."""
        version = self._identity_files()
        with self._identity_lock:
            if version == self._identity_version:
                return None
            self._identity_version = version
            try:
                new = load_identity(self.config.identity)
                if new.name != self.name:
                    raise FailedPrecondition(f"its certificate names {new.name!r}, this site is {self.name!r}")
            except (NotFound, FailedPrecondition, InvalidArgument, PermissionDenied) as e:
                log.warning(
                    "identity files changed but do not load (%s); still serving as %s", e, self.identity.fingerprint
                )
                return None
            if new.fingerprint == self.identity.fingerprint:
                return None
            self.identity = new
            return new.fingerprint

    def _current_pins(self) -> tuple[tuple, dict[str, PinnedPeer], list[PinnedPeer]]:
        version = self.trust.version()
        with self._pins_lock:
            if version != self._pins[0]:
                self._pins = (version, self.trust.peers(), self.trust.pins())
            return self._pins

    def pinned(self) -> dict[str, PinnedPeer]:
        return self._current_pins()[1]

    def pinned_by_fingerprint(self, fp: str) -> PinnedPeer | None:
        """The pin with this fingerprint: a site's certificate, or the next one it rotates to."""
        for p in self._current_pins()[2]:
            if p.fingerprint == fp:
                return p
        return None
