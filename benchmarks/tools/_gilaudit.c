/* An LD_AUDIT library that counts the GIL releases of a Python process's extension modules.
 *
 * Each call an extension module (torch, nvImageCodec, numpy, Pillow) makes to PyEval_SaveThread is
 * re-bound, when the dynamic linker binds it, to a wrapper that counts it. Binding through the audit
 * interface works whether the interpreter links libpython statically (Debian's and Ubuntu's python3)
 * or not; LD_PRELOAD would not, since the executable's own symbol comes first. The interpreter's calls
 * from inside itself (os.read, lock waits) are not seen.
 *
 * An audit library lives in a link namespace of its own, so the count is shared through the file named
 * by GILC_FILE: a 64-bit count at its start, which benchmarks/gil_releases.py reads with mmap.
 *
 * Built by benchmarks/gil_releases.py: cc -O2 -shared -fPIC -o libgilaudit.so _gilaudit.c
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <link.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static atomic_long *releases = 0;
static void *(*save_thread)(void) = 0;

static void *counting_save_thread(void) {
    if (releases)
        atomic_fetch_add(releases, 1);
    return save_thread();
}

unsigned int la_version(unsigned int version) {
    const char *path = getenv("GILC_FILE");
    if (path) {
        int fd = open(path, O_RDWR | O_CREAT, 0600);
        if (fd >= 0 && ftruncate(fd, 4096) == 0) {
            void *shared = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (shared != MAP_FAILED)
                releases = (atomic_long *)shared;
        }
        if (fd >= 0)
            close(fd);
    }
    return version < LAV_CURRENT ? version : LAV_CURRENT;
}

unsigned int la_objopen(struct link_map *map, Lmid_t lmid, uintptr_t *cookie) {
    return LA_FLG_BINDTO | LA_FLG_BINDFROM;
}

uintptr_t la_symbind64(Elf64_Sym *sym, unsigned int ndx, uintptr_t *refcook, uintptr_t *defcook,
                       unsigned int *flags, const char *symname) {
    if (strcmp(symname, "PyEval_SaveThread") == 0) {
        if (!save_thread)
            save_thread = (void *(*)(void))sym->st_value;
        return (uintptr_t)&counting_save_thread;
    }
    return sym->st_value;
}
