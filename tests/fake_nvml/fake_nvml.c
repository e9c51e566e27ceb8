/*
 * A fake libnvidia-ml.so.1 for tests: the NVML functions gpushare's agent
 * calls, answering from a plain-text file named by $FAKE_NVML_CONFIG.
 *
 * The file is re-read on every call, so a test can change what the "driver"
 * reports (a job's PIDs, its memory, an XID event) while the agent runs.
 * Lines (anything else is ignored):
 *
 *   driver 550.54.15
 *   cuda 12040
 *   gpu <uuid> <memory_mib> <util_gpu> <util_mem> <power_mw> <energy_mj> <temp_c> <mig 0|1> <name...>
 *   mig <gpu_index> <uuid> <memory_mib> <gpu_instance_id>
 *   proc <gpu_index> <pid> <used_mib> <sm_util> <mem_util> <compute|mps>
 *   event <id> <gpu_index> <event_type> <event_data>
 *   fail <function_name> <nvml_return_code>
 *
 * Energy grows by power_mw per second since nvmlInit (mW x s = mJ) on top of
 * the configured base. Events are delivered once each, in id order.
 * Compile with -DOMIT_<function_name> to leave a function out of the library
 * (pynvml then raises NVMLError_FunctionNotFound, as on an older driver).
 *
 * gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_MIG 64
#define MAX_PROCS 256
#define MAX_EVENTS 64
#define MAX_FAILS 32

struct fake_gpu {
    int present;
    char uuid[96];
    char name[96];
    unsigned long long memory_mib;
    unsigned int util_gpu, util_mem, power_mw, temp_c, mig;
    unsigned long long energy_mj;
    int parent;              /* -1 for a physical GPU, else the parent's index (MIG device) */
    unsigned int gi_id;      /* MIG GPU instance id */
};
typedef struct fake_gpu *nvmlDevice_t;

struct fake_proc {
    int gpu;
    unsigned int pid;
    unsigned long long used_mib;
    unsigned int sm_util, mem_util;
    int mps;
};

struct fake_event {
    unsigned long long id;
    int gpu;
    unsigned long long type, data;
};

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct { unsigned long long mask; } *nvmlEventSet_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

static struct fake_gpu gpus[MAX_GPUS];
static struct fake_gpu migs[MAX_MIG];
static int n_gpus, n_migs;
static struct fake_proc procs[MAX_PROCS];
static int n_procs;
static struct fake_event events[MAX_EVENTS];
static int n_events;
static struct { char name[80]; int code; } fails[MAX_FAILS];
static int n_fails;
static char driver[32] = "550.54.15";
static int cuda = 12040;
static int initialised;
static double init_time;
static unsigned long long delivered_event;
__attribute__((unused)) static struct { unsigned long long mask; } the_event_set;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void load(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    char line[512];
    n_gpus = n_migs = n_procs = n_events = n_fails = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char word[16] = "";
        if (sscanf(line, "%15s", word) != 1) continue;
        if (!strcmp(word, "driver")) {
            sscanf(line, "driver %31s", driver);
        } else if (!strcmp(word, "cuda")) {
            sscanf(line, "cuda %d", &cuda);
        } else if (!strcmp(word, "gpu") && n_gpus < MAX_GPUS) {
            struct fake_gpu *g = &gpus[n_gpus];
            memset(g, 0, sizeof *g);
            if (sscanf(line, "gpu %95s %llu %u %u %u %llu %u %u %95[^\n]", g->uuid, &g->memory_mib, &g->util_gpu,
                       &g->util_mem, &g->power_mw, &g->energy_mj, &g->temp_c, &g->mig, g->name) == 9) {
                g->present = 1;
                g->parent = -1;
                n_gpus++;
            }
        } else if (!strcmp(word, "mig") && n_migs < MAX_MIG) {
            struct fake_gpu *g = &migs[n_migs];
            memset(g, 0, sizeof *g);
            if (sscanf(line, "mig %d %95s %llu %u", &g->parent, g->uuid, &g->memory_mib, &g->gi_id) == 4) {
                g->present = 1;
                snprintf(g->name, sizeof g->name, "MIG instance %u", g->gi_id);
                n_migs++;
            }
        } else if (!strcmp(word, "proc") && n_procs < MAX_PROCS) {
            struct fake_proc *p = &procs[n_procs];
            char kind[16] = "compute";
            if (sscanf(line, "proc %d %u %llu %u %u %15s", &p->gpu, &p->pid, &p->used_mib, &p->sm_util, &p->mem_util,
                       kind) >= 5) {
                p->mps = !strcmp(kind, "mps");
                n_procs++;
            }
        } else if (!strcmp(word, "event") && n_events < MAX_EVENTS) {
            struct fake_event *e = &events[n_events];
            if (sscanf(line, "event %llu %d %llu %llu", &e->id, &e->gpu, &e->type, &e->data) == 4) n_events++;
        } else if (!strcmp(word, "fail") && n_fails < MAX_FAILS) {
            if (sscanf(line, "fail %79s %d", fails[n_fails].name, &fails[n_fails].code) == 2) n_fails++;
        }
    }
    fclose(f);
}

/* Re-read the file; return the configured failure for ``fn`` (0 when none). */
static int enter(const char *fn) {
    load();
    for (int i = 0; i < n_fails; i++)
        if (!strcmp(fails[i].name, fn)) return fails[i].code;
    return 0;
}

#define ENTER(fn)                                  \
    do {                                           \
        int failure_ = enter(fn);                  \
        if (failure_) return failure_;             \
        if (!initialised) return NVML_ERROR_UNINITIALIZED; \
    } while (0)

static int gpu_index(nvmlDevice_t device) {
    if (device >= gpus && device < gpus + n_gpus) return (int)(device - gpus);
    return -1;
}

static int valid(nvmlDevice_t device) {
    return (device >= gpus && device < gpus + n_gpus) || (device >= migs && device < migs + n_migs);
}

/* --- init ------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    int failure = enter("nvmlInit");
    if (failure) return failure;
    if (!initialised) {
        init_time = now_s();
        delivered_event = 0;
    }
    initialised++;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (initialised) initialised--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

/* --- system ----------------------------------------------------------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER("nvmlSystemGetDriverVersion");
    snprintf(version, length, "%s", driver);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    ENTER("nvmlSystemGetCudaDriverVersion");
    *version = cuda;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

/* --- inventory -------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER("nvmlDeviceGetCount");
    *count = (unsigned int)n_gpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER("nvmlDeviceGetHandleByIndex");
    if (index >= (unsigned int)n_gpus) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER("nvmlDeviceGetIndex");
    int i = gpu_index(device);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)i;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER("nvmlDeviceGetUUID");
    if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(uuid, length, "%s", device->uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER("nvmlDeviceGetName");
    if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(name, length, "%s", device->name);
    return NVML_SUCCESS;
}

static unsigned long long used_mib(nvmlDevice_t device) {
    int i = gpu_index(device);
    unsigned long long used = 0;
    for (int p = 0; p < n_procs; p++)
        if (procs[p].gpu == i) used += procs[p].used_mib;
    return used;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER("nvmlDeviceGetMemoryInfo");
    if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = device->memory_mib << 20;
    memory->used = used_mib(device) << 20;
    memory->free = memory->total > memory->used ? memory->total - memory->used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    ENTER("nvmlDeviceGetMigMode");
    if (gpu_index(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = device->mig;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER("nvmlDeviceGetMaxMigDeviceCount");
    if (gpu_index(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device->mig ? 7 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
    ENTER("nvmlDeviceGetMigDeviceHandleByIndex");
    int parent = gpu_index(device);
    unsigned int seen = 0;
    if (parent < 0 || !device->mig) return NVML_ERROR_INVALID_ARGUMENT;
    for (int m = 0; m < n_migs; m++) {
        if (migs[m].parent != parent) continue;
        if (seen++ == index) {
            *mig = &migs[m];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    ENTER("nvmlDeviceGetGpuInstanceId");
    if (!(device >= migs && device < migs + n_migs)) return NVML_ERROR_NOT_SUPPORTED;
    *id = device->gi_id;
    return NVML_SUCCESS;
}

/* --- metrics ---------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    ENTER("nvmlDeviceGetUtilizationRates");
    if (gpu_index(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = device->util_gpu;
    util->memory = device->util_mem;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    ENTER("nvmlDeviceGetPowerUsage");
    if (gpu_index(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *power = device->power_mw;
    return NVML_SUCCESS;
}

#ifndef OMIT_nvmlDeviceGetTotalEnergyConsumption
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy) {
    ENTER("nvmlDeviceGetTotalEnergyConsumption");
    if (gpu_index(device) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *energy = device->energy_mj + (unsigned long long)(device->power_mw * (now_s() - init_time));
    return NVML_SUCCESS;
}
#endif

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    ENTER("nvmlDeviceGetTemperature");
    if (gpu_index(device) < 0 || sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = device->temp_c;
    return NVML_SUCCESS;
}

__attribute__((unused)) static nvmlReturn_t list_processes(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos, int mps) {
    int i = gpu_index(device);
    unsigned int n = 0;
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    for (int p = 0; p < n_procs; p++)
        if (procs[p].gpu == i && procs[p].mps == mps) n++;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    n = 0;
    for (int p = 0; p < n_procs; p++) {
        if (procs[p].gpu != i || procs[p].mps != mps) continue;
        infos[n].pid = procs[p].pid;
        infos[n].usedGpuMemory = procs[p].used_mib << 20;
        infos[n].gpuInstanceId = 0xFFFFFFFF;
        infos[n].computeInstanceId = 0xFFFFFFFF;
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

#ifndef OMIT_nvmlDeviceGetComputeRunningProcesses_v3
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    ENTER("nvmlDeviceGetComputeRunningProcesses");
    return list_processes(device, count, infos, 0);
}
#endif

#ifndef OMIT_nvmlDeviceGetMPSComputeRunningProcesses_v3
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                        nvmlProcessInfo_t *infos) {
    ENTER("nvmlDeviceGetMPSComputeRunningProcesses");
    return list_processes(device, count, infos, 1);
}
#endif

#ifndef OMIT_nvmlDeviceGetProcessUtilization
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long last_seen) {
    ENTER("nvmlDeviceGetProcessUtilization");
    int i = gpu_index(device);
    unsigned int n = 0;
    unsigned long long stamp = (unsigned long long)(now_s() * 1e6);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (stamp <= last_seen) return NVML_ERROR_NOT_FOUND;
    for (int p = 0; p < n_procs; p++)
        if (procs[p].gpu == i && procs[p].sm_util > 0) n++;
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (samples == NULL || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    n = 0;
    for (int p = 0; p < n_procs; p++) {
        if (procs[p].gpu != i || procs[p].sm_util == 0) continue;
        samples[n].pid = procs[p].pid;
        samples[n].timeStamp = stamp;
        samples[n].smUtil = procs[p].sm_util;
        samples[n].memUtil = procs[p].mem_util;
        samples[n].encUtil = samples[n].decUtil = 0;
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}
#endif

/* --- events ----------------------------------------------------------- */

#ifndef OMIT_nvmlEventSetCreate
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    ENTER("nvmlEventSetCreate");
    *set = (nvmlEventSet_t)&the_event_set;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    ENTER("nvmlDeviceRegisterEvents");
    if (gpu_index(device) < 0 || set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    set->mask |= types;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)timeout_ms;
    ENTER("nvmlEventSetWait");
    struct fake_event *next = NULL;
    for (int e = 0; e < n_events; e++) {
        struct fake_event *ev = &events[e];
        if (ev->id > delivered_event && (ev->type & set->mask) && ev->gpu >= 0 && ev->gpu < n_gpus &&
            (next == NULL || ev->id < next->id))
            next = ev;
    }
    if (next == NULL) return NVML_ERROR_TIMEOUT;
    delivered_event = next->id;
    data->device = &gpus[next->gpu];
    data->eventType = next->type;
    data->eventData = next->data;
    data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFF;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    (void)set;
    return NVML_SUCCESS;
}
#endif
