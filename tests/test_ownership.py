"""The one ownership check every place that trusts a path uses: real files,
directories, sockets and links, and a real other owner (the tests run as root)."""

import os
import socket

import pytest

from kvtier.ownership import GROUP_OTHERS_ANY, distrust, ours, ours_or_root

OTHER_UID = 41013


@pytest.fixture
def place(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x" * 10)
    os.chmod(f, 0o600)
    return tmp_path, str(f)


def test_a_private_file_of_ours_is_trusted_and_each_fault_is_named(place):
    d, f = place
    assert distrust(os.lstat(f), "regular file", ours()) == ""
    assert distrust(os.lstat(f), "regular file", ours(), deny=GROUP_OTHERS_ANY, size=10) == ""
    assert distrust(os.lstat(f), "regular file", ours(), size=11) == "10 bytes, expected 11"
    os.chmod(f, 0o640)
    assert distrust(os.lstat(f), "regular file", ours(), deny=GROUP_OTHERS_ANY) == \
        "mode 0640 lets group or others read it"
    os.chmod(f, 0o620)
    assert distrust(os.lstat(f), "regular file", ours()) == "mode 0620 lets group or others write to it"
    assert distrust(os.lstat(f), "regular file", ours(), mode=0o600) == "mode 0620, expected 0600"
    assert distrust(os.lstat(f), "regular file", ours(), mode=0o620) == ""


def test_another_users_file_is_refused_unless_that_user_is_expected(place):
    _, f = place
    os.chown(f, OTHER_UID, -1)
    why = distrust(os.lstat(f), "regular file", ours())
    assert why.startswith(f"belongs to uid {OTHER_UID}, not to the daemon's user")
    assert distrust(os.lstat(f), "regular file", {OTHER_UID}) == ""
    assert f"belongs to uid {OTHER_UID}" in distrust(os.lstat(f), "regular file", ours_or_root())


def test_a_link_a_directory_and_a_socket_are_each_only_what_they_are(place):
    d, f = place
    link = str(d / "link")
    os.symlink(f, link)
    assert distrust(os.lstat(link), "regular file", ours()) == "not a regular file"
    assert distrust(os.lstat(str(d)), "regular file", ours()) == "not a regular file"
    assert distrust(os.lstat(f), "directory", ours()) == "not a directory"
    os.chmod(d, 0o700)
    assert distrust(os.lstat(str(d)), "directory", ours()) == ""
    os.chmod(d, 0o1777)  # a world-writable directory, sticky or not, is refused for a socket dir
    assert "lets group or others write" in distrust(os.lstat(str(d)), "directory", ours())
    path = str(d / "s")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        assert distrust(os.lstat(path), "socket", ours(), deny=0) == ""
        assert distrust(os.lstat(path), "regular file", ours()) == "not a regular file"
