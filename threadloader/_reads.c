/*
 * A group's files read in two calls, for threadloader's read stage (_filereads.py).
 *
 * Why C: Python's reads of one file (os.open, os.fstat, os.read, os.close) let go of the GIL four
 * times, and each time a training loop beside the readers may take it, and the reader must wait to
 * win it back: a hand-off per system call. Through ctypes, which lets go of the GIL once per call,
 * a whole group of files costs two: one call opens them all and reads their sizes, so that Python
 * can make a bytes object of each size, the other reads them into those and closes them. A tar
 * shard's members, ranges of files already open, cost one (tl_read_ranges) where Python's pread costs
 * one each.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/*
 * Reads up to want bytes of fd into buf, from offset, or from its position where offset is negative
 * (read, not pread: files such as /proc's that state no size may not take pread), going on after
 * short reads until the file ends: the bytes read. *err is set to a read's errno, where one fails.
 */
static long long read_at(int fd, unsigned char *buf, long long want, long long offset, int *err) {
    long long have = 0;
    while (have < want) {
        ssize_t step = offset < 0 ? read(fd, buf + have, (size_t)(want - have))
                                  : pread(fd, buf + have, (size_t)(want - have), (off_t)(offset + have));
        if (step < 0 && errno == EINTR) {
            continue;
        }
        if (step < 0) {
            *err = errno;
            break;
        }
        if (step == 0) {
            break;
        }
        have += step;
    }
    return have;
}

/*
 * Opens each of the n paths with flags (and O_CLOEXEC) and reads its status.
 *
 * Per path: fds[i] the open descriptor, or -1 where opening or its fstat failed (errs[i] the errno);
 * modes[i] its st_mode; sizes[i] its st_size where it is a regular file, else -1. Every fds[i] that is
 * not -1 must be closed by tl_read_files or tl_close_files.
 */
void tl_open_files(int n, const char *const *paths, int flags, int *fds, long long *sizes, unsigned *modes,
                   int *errs) {
    for (int i = 0; i < n; i++) {
        struct stat status;
        int fd;
        fds[i] = -1;
        sizes[i] = -1;
        modes[i] = 0;
        errs[i] = 0;
        do {
            fd = open(paths[i], flags | O_CLOEXEC);
        } while (fd < 0 && errno == EINTR);
        if (fd < 0) {
            errs[i] = errno;
            continue;
        }
        if (fstat(fd, &status) != 0) {
            errs[i] = errno;
            close(fd);
            continue;
        }
        fds[i] = fd;
        modes[i] = (unsigned)status.st_mode;
        if (S_ISREG(status.st_mode)) {
            sizes[i] = (long long)status.st_size;
        }
    }
}

/*
 * Reads each regular file (sizes[i] >= 0) into bufs[i], sizes[i] bytes, then tries one byte more: a
 * file that has it grew past its stated size. got[i] is the bytes read, sizes[i] + 1 for such a file;
 * errs[i] a read's errno, else 0. Closes every descriptor, read or not, and sets it to -1.
 */
void tl_read_files(int n, int *fds, const long long *sizes, unsigned char *const *bufs, long long *got,
                   int *errs) {
    for (int i = 0; i < n; i++) {
        got[i] = 0;
        if (fds[i] < 0) {
            continue;
        }
        if (sizes[i] >= 0) {
            unsigned char more;
            got[i] = read_at(fds[i], bufs[i], sizes[i], -1, &errs[i]);
            if (got[i] == sizes[i] && !errs[i]) {
                got[i] += read_at(fds[i], &more, 1, -1, &errs[i]);
            }
        }
        close(fds[i]);
        fds[i] = -1;
    }
}

/* Closes the descriptors tl_open_files left open (where reading them was not reached). */
void tl_close_files(int n, int *fds) {
    for (int i = 0; i < n; i++) {
        if (fds[i] >= 0) {
            close(fds[i]);
            fds[i] = -1;
        }
    }
}

/*
 * Reads n byte ranges of open files: range i is sizes[i] bytes of fds[i] from offsets[i], into bufs[i].
 * got[i] is the bytes read, fewer only where the file ends first; errs[i] a read's errno, else 0. The
 * descriptors stay open: they are the caller's.
 */
void tl_read_ranges(int n, const int *fds, const long long *offsets, const long long *sizes,
                    unsigned char *const *bufs, long long *got, int *errs) {
    for (int i = 0; i < n; i++) {
        errs[i] = 0;
        got[i] = read_at(fds[i], bufs[i], sizes[i], offsets[i], &errs[i]);
    }
}
